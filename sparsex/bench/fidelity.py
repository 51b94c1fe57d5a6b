"""Fidelity of a cache policy against full prefill, by teacher forcing.

For a prompt: greedy-decode `num_tokens` under full prefill (cache="none") -> continuation C and the
reference next-token distributions. Then run prompt + C under the policy as a prompt (C is new
content, never reused) and compare, at every position of C, the policy's full next-token
distribution with the reference one:
  top1         argmax(policy) == C[t] (the reference's greedy token)
  kl           KL(reference || policy), nats
  match_len    tokens before the first top-1 disagreement: exactly the length of the identical prefix
               that free-running greedy decoding under the policy would produce.
  miss_margins at every top-1 disagreement, the reference's margin p(top-1) - p(second): how close to
               a tie the position was under full prefill (a near-tie flips under any perturbation,
               bf16 rounding included).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from sparsex.engine.llm_engine import LLMEngine
from sparsex.engine.quality_monitor import PositionMetrics, compare_positions  # noqa: F401  (one definition, shared with the live monitor)
from sparsex.inputs import TokenizedPrompt, tokenize_pieces
from sparsex.outputs import RequestOutput
from sparsex.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class FidelityResult:
    top1: float
    kl: float
    match_len: int
    ttft: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_reused_tokens: int
    num_recomputed_tokens: int
    miss_margins: tuple[float, ...] = ()
    position_kl: tuple[float, ...] = ()
    miss_positions: tuple[int, ...] = ()


def pieces_prompt(engine: LLMEngine, pieces: list[str | list[int]], reusable: list[bool]) -> TokenizedPrompt:
    return tokenize_pieces(engine.tokenizer, pieces, engine.model_config.vocab_size, reusable)


def run_to_completion(engine: LLMEngine, prompt, params: SamplingParams, reuse: dict | None = None,
                      distributions_from: int | None = None) -> tuple[RequestOutput, dict[int, torch.Tensor]]:
    """Run one request alone to completion; with `distributions_from`, also its full next-token
    log-distributions from that position on (`SamplingParams.distributions_from`)."""
    rid = f"fid-{next(_ids)}"
    if distributions_from is not None:
        params = dataclasses.replace(params, distributions_from=distributions_from)
    engine.add_request(rid, prompt, params, reuse=reuse)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out, out.distributions or {}


def reference(ref_engine: LLMEngine, prompt: TokenizedPrompt, num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Full-prefill greedy continuation and its next-token log-distributions."""
    out, _ = run_to_completion(ref_engine, prompt, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    cont = out.outputs[0].token_ids
    full = TokenizedPrompt(prompt.token_ids + cont, None, [])
    n = len(prompt.token_ids)
    _, cap = run_to_completion(ref_engine, full, SamplingParams(temperature=0, max_tokens=1), distributions_from=n - 1)
    return cont, [cap[p] for p in range(n - 1, n + len(cont) - 1)]


def teacher_forced(engine: LLMEngine, prompt: TokenizedPrompt, cont: list[int], ref_lps: list[torch.Tensor],
                   reuse: dict | None = None, approx_prefix: bool = False) -> FidelityResult:
    """Fidelity of the engine's policy on `prompt` against the full-prefill reference `ref_lps`.

    `approx_prefix` off (the default) blends every reused segment afresh: teacher forcing the same
    prompt under several policies in one engine must not continue the previous run's blended blocks.
    A replay that runs each prompt once, in order (the workload bench), turns it on, as served."""
    reuse = {**(reuse or {}), "approx_prefix": approx_prefix}
    n = len(prompt.token_ids)
    full = TokenizedPrompt(prompt.token_ids + cont, None, list(prompt.segments), prompt.cache_salt, query_horizon=n)
    out, cap = run_to_completion(engine, full, SamplingParams(temperature=0, max_tokens=1), reuse=reuse,
                                 distributions_from=n - 1)
    m = compare_positions(ref_lps, [cap[n - 1 + t] for t in range(len(ref_lps))], cont)
    return FidelityResult(m.top1, m.kl, m.match_len, out.metrics.ttft or 0.0, len(full.token_ids),
                          out.num_cached_tokens, out.num_reused_tokens, out.num_recomputed_tokens, m.miss_margins,
                          m.position_kl, m.miss_positions)

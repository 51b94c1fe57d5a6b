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
from sparsex.engine.teacher_forcing import compare_positions, continuation_distributions, run_alone
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
    if distributions_from is not None:
        params = dataclasses.replace(params, distributions_from=distributions_from)
    out = run_alone(engine, f"fid-{next(_ids)}", prompt, params, reuse)
    return out, out.distributions or {}


def reference(ref_engine: LLMEngine, prompt: TokenizedPrompt, num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Full-prefill greedy continuation and its next-token log-distributions, captured as it is decoded
    (one run, as the workload bench's `replay.compute_reference` does)."""
    n = len(prompt.token_ids)
    out, cap = run_to_completion(ref_engine, prompt, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True),
                                 distributions_from=n - 1)
    cont = out.outputs[0].token_ids
    return cont, [cap[n - 1 + t] for t in range(len(cont))]


def teacher_forced(engine: LLMEngine, prompt: TokenizedPrompt, cont: list[int], ref_lps: list[torch.Tensor],
                   reuse: dict | None = None, approx_prefix: bool = False) -> FidelityResult:
    """Fidelity of the engine's policy on `prompt` against the full-prefill reference `ref_lps`.

    `approx_prefix` off (the default) blends every reused segment afresh: teacher forcing the same
    prompt under several policies in one engine must not continue the previous run's blended blocks.
    A replay that runs each prompt once, in order (the workload bench), turns it on, as served."""
    out, lps = _continuation(engine, prompt, cont, {**(reuse or {}), "approx_prefix": approx_prefix})
    m = compare_positions(ref_lps, lps, cont)
    return FidelityResult(m.top1, m.kl, m.match_len, out.metrics.ttft or 0.0, len(prompt.token_ids) + len(cont),
                          out.num_cached_tokens, out.num_reused_tokens, out.num_recomputed_tokens, m.miss_margins,
                          m.position_kl, m.miss_positions)


def _continuation(engine: LLMEngine, prompt: TokenizedPrompt, cont: list[int], reuse: dict | None = None):
    got = continuation_distributions(engine, f"fid-{next(_ids)}", prompt, cont, reuse)
    if got is None:
        raise RuntimeError(f"the engine aborted a teacher-forced run of {len(prompt.token_ids) + len(cont)} tokens "
                           f"(a KV pool too small for it?)")
    return got

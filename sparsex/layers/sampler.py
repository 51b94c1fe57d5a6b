"""Next-token sampling over a batch of final-position logits (vLLM-v1 semantics) and logprobs.

Per row, in this order (as vLLM v1 does):
  logit_bias added, then the structured-output token bitmask (layers/token_bitmask.py): disallowed
    tokens -> -inf; both before everything below, greedy included.
  greedy (temperature < GREEDY_TEMPERATURE_EPS): argmax of the raw logits, ties to the lowest id;
    every other knob is ignored.
  otherwise: logits / temperature -> min_p (drop tokens whose prob < min_p * max prob)
    -> top_k (keep the k largest; ties with the k-th are kept too) -> top_p on the renormalised
    survivors (keep the smallest prefix, by descending prob, whose mass >= top_p; the top token
    always stays) -> sample.

Sampling is the exponential race: argmax_i(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks i with
probability p_i. Its only randomness is the noise tensor, drawn per row from that row's generator,
so a seeded row's token depends on nothing but its own logits, knobs and generator state.

Logprobs always describe the raw model distribution (log_softmax of the unmodified logits), like
vLLM's default, whatever temperature, truncation, logit_bias or bitmask was used to pick the token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsex.layers.token_bitmask import apply_token_bitmask_
from sparsex.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams


_TOP_K_CAP = 2**31 - 1  # larger than any vocabulary


@dataclass
class LogitBias:
    """Every row's logit_bias as flat (row, token, value) triples: a handful of entries, not a
    [num_seqs, vocab] tensor."""
    rows: torch.Tensor          # [num_entries] int64
    token_ids: torch.Tensor     # [num_entries] int64
    values: torch.Tensor        # [num_entries] float32

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> LogitBias | None:
        """None when no row has a bias. Host tensors."""
        rows, ids, values = [], [], []
        for row, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                rows.append(row); ids.append(tok); values.append(float(bias))
        if not rows:
            return None
        return cls(torch.tensor(rows, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
                   torch.tensor(values, dtype=torch.float32))

    def to(self, device: torch.device) -> LogitBias:
        """On CUDA: pinned, then one non_blocking copy each (no host sync)."""
        if torch.device(device).type != "cuda":
            return self
        move = lambda t: t.pin_memory().to(device, non_blocking=True)
        return LogitBias(move(self.rows), move(self.token_ids), move(self.values))


@dataclass
class SamplingBatch:
    """Per-row sampling knobs; built by the model runner once per step, one row per sequence."""

    temperature: torch.Tensor   # [num_seqs] float32 (< GREEDY_TEMPERATURE_EPS => greedy row)
    top_p: torch.Tensor         # [num_seqs] float32 (1 => disabled)
    top_k: torch.Tensor         # [num_seqs] int64 (0 => disabled)
    min_p: torch.Tensor         # [num_seqs] float32 (0 => disabled)
    # Per row; a seeded request owns its generator, so its tokens do not depend on the batch.
    # None: the global RNG of the logits' device.
    generators: list[torch.Generator | None]
    max_num_logprobs: int | None   # max over rows of SamplingParams.logprobs (None: nobody asked)
    all_greedy: bool
    # Host-side hints that let the sampler skip a whole filter without reading the tensors
    # (which would sync with the device). False is always safe: the filter is then applied and
    # is an exact no-op on rows that disabled it.
    no_top_k: bool = False
    no_top_p: bool = False
    no_min_p: bool = False
    logit_bias: LogitBias | None = None          # None: no row has one
    # [num_seqs, ceil(vocab / 32)] int32 on the logits' device (layers/token_bitmask.py), set by the
    # model runner from the rows' grammars (engine/structured_output.py); None: no row is constrained
    token_bitmask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.generators)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
    ) -> "SamplingBatch":
        if len(params) != len(generators):
            raise ValueError(
                f"need one generator slot per row: len(params)={len(params)}, "
                f"len(generators)={len(generators)}"
            )
        for i, (p, g) in enumerate(zip(params, generators)):
            # A seeded request silently falling back to the global RNG would break its promise
            # of reproducibility without any visible error, so refuse it here.
            if p.seed is not None and g is None:
                raise ValueError(f"row {i} has seed={p.seed} but no generator")

        # Greedy rows are stored with temperature 0 so the tensor alone says which rows are greedy.
        temperature = [0.0 if p.greedy else float(p.temperature) for p in params]
        # A greedy row's other knobs are irrelevant; ignoring them lets the skip hints fire more often.
        sampled = [p for p in params if not p.greedy]
        logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
            # A top_k at or above the vocabulary keeps every token; clamping keeps an arbitrary
            # Python int (the API allows any positive integer) inside int64.
            top_k=torch.tensor([min(p.top_k, _TOP_K_CAP) for p in params], dtype=torch.int64, device=device),
            min_p=torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device),
            generators=list(generators),
            max_num_logprobs=max(logprob_ks) if logprob_ks else None,
            all_greedy=not sampled,
            no_top_k=all(p.top_k == 0 for p in sampled),
            no_top_p=all(p.top_p >= 1.0 for p in sampled),
            no_min_p=all(p.min_p == 0.0 for p in sampled),
            logit_bias=LogitBias.from_params(params),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # [num_seqs] int64
    sampled_logprobs: torch.Tensor | None    # [num_seqs] float32, raw-model logprob of the sampled token
    topk_token_ids: torch.Tensor | None      # [num_seqs, max_num_logprobs] int64
    topk_logprobs: torch.Tensor | None       # [num_seqs, max_num_logprobs] float32, descending


def compute_topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k tokens of log_softmax(logits) per row, sorted by descending logprob.

    logits: [num_tokens, vocab_size] any float dtype. Returns (ids [num_tokens, k] int64,
    logprobs [num_tokens, k] float32). Used for sampled tokens and for prompt_logprobs.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_tokens, vocab_size], got shape {tuple(logits.shape)}")
    if not 0 <= k <= logits.shape[1]:
        raise ValueError(f"k must be in [0, vocab_size={logits.shape[1]}], got {k}")
    logits = logits.float()
    # log_softmax is a per-row shift, so the top-k of the logits are the top-k of the logprobs;
    # subtracting the logsumexp afterwards avoids a second [num_tokens, vocab_size] tensor.
    values, ids = logits.topk(k, dim=-1)                       # [num_tokens, k]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)        # [num_tokens, 1]
    return ids, values - lse


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[t, token_ids[t]] per row: [num_tokens, vocab_size], [num_tokens] -> [num_tokens]."""
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"need logits [num_tokens, vocab_size] and token_ids [num_tokens], got "
            f"{tuple(logits.shape)} and {tuple(token_ids.shape)}"
        )
    logits = logits.float()
    picked = logits.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)   # [num_tokens]
    return picked - torch.logsumexp(logits, dim=-1)


class Sampler:
    """Stateless: all per-step state is in the SamplingBatch (and its generators)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_seqs or batch.temperature.shape != (batch.num_seqs,):
            raise ValueError(
                f"logits must be [num_seqs, vocab_size] with num_seqs={batch.num_seqs} "
                f"(len(generators)), got logits {tuple(logits.shape)}, "
                f"temperature {tuple(batch.temperature.shape)}"
            )
        # .float() returns the input itself when it already is float32: never modify it in place.
        logits32 = logits.float()                               # [num_seqs, vocab_size]
        scores = _biased_and_masked(logits32, batch)            # what is sampled from (logprobs stay raw)

        greedy_ids = scores.argmax(dim=-1)                      # [num_seqs]
        if batch.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = self._sample(scores, batch)            # [num_seqs]
            is_greedy = batch.temperature < GREEDY_TEMPERATURE_EPS
            sampled = torch.where(is_greedy, greedy_ids, random_ids)

        if batch.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        topk_ids, topk_lp = compute_topk_logprobs(logits32, batch.max_num_logprobs)
        return SamplerOutput(
            sampled_token_ids=sampled,
            sampled_logprobs=token_logprobs(logits32, sampled),
            topk_token_ids=topk_ids,
            topk_logprobs=topk_lp,
        )

    @staticmethod
    def _sample(logits32: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Truncate and sample every row (greedy rows too; the caller overrides them). -> [num_seqs]."""
        # Greedy rows get temperature 1 so the division stays finite; their result is discarded.
        temp = torch.where(
            batch.temperature < GREEDY_TEMPERATURE_EPS,
            torch.ones_like(batch.temperature),
            batch.temperature,
        )
        x = logits32 / temp.unsqueeze(1)                        # [num_seqs, vocab_size], a fresh tensor

        if not batch.no_min_p:
            probs = x.softmax(dim=-1)                           # [num_seqs, vocab_size]
            threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)   # [num_seqs, 1]
            # min_p <= 1 so the max token always survives; min_p = 0 removes nothing.
            x.masked_fill_(probs < threshold, float("-inf"))

        if not (batch.no_top_k and batch.no_top_p):
            x = _apply_top_k_top_p(
                x,
                None if batch.no_top_k else batch.top_k,
                None if batch.no_top_p else batch.top_p,
            )

        probs = x.softmax(dim=-1)                               # [num_seqs, vocab_size], 0 on removed tokens
        noise = _exponential_noise(probs, batch.generators)     # [num_seqs, vocab_size]
        return probs.div_(noise).argmax(dim=-1)


def _biased_and_masked(logits32: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits32 + logit_bias, disallowed tokens at -inf: a new tensor when either applies, else logits32."""
    if batch.logit_bias is None and batch.token_bitmask is None:
        return logits32
    scores = logits32.clone()                                   # [num_seqs, vocab_size]
    bias = batch.logit_bias
    if bias is not None:
        scores.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if batch.token_bitmask is not None:
        apply_token_bitmask_(scores, batch.token_bitmask)       # after the bias: a bias cannot re-allow a token
    return scores


def _apply_top_k_top_p(
    x: torch.Tensor,                # [num_seqs, vocab_size] temperature-scaled logits, -inf = removed
    top_k: torch.Tensor | None,     # [num_seqs] int64, 0 => disabled; None: no row uses it
    top_p: torch.Tensor | None,     # [num_seqs] float32, >= 1 => disabled; None: no row uses it
) -> torch.Tensor:
    """Mask (to -inf) what top_k then top_p remove; the result stays in vocabulary order.

    The mask is computed in sorted order and scattered back rather than sampling in sorted order:
    the per-token noise must line up with token ids, or a row's token would change with whether
    some *other* row of the batch needed sorting.
    """
    vocab_size = x.shape[1]
    # Stable descending sort: equal logits keep ascending-id order, so ties resolve the same way
    # on every run and every device.
    sorted_x, sorted_ids = x.sort(dim=-1, descending=True, stable=True)   # [num_seqs, vocab_size]

    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)   # [num_seqs]
        kth = sorted_x.gather(1, (k - 1).unsqueeze(1))                        # [num_seqs, 1]
        # By value rather than by rank: tokens tied with the k-th are kept (vLLM does the same).
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))

    if top_p is not None:
        sorted_probs = sorted_x.softmax(dim=-1)                 # renormalised over the top-k survivors
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs   # [num_seqs, vocab_size], exclusive
        # A token stays while the mass strictly above it is < top_p: the smallest prefix reaching top_p.
        # The first token has mass_before 0 < top_p, so it always stays. Rows with top_p >= 1 are
        # exempt so float rounding in the cumsum cannot drop their tiny-probability tail.
        remove = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_x = sorted_x.masked_fill(remove, float("-inf"))

    return torch.empty_like(x).scatter_(1, sorted_ids, sorted_x)


def _exponential_noise(
    probs: torch.Tensor,                           # [num_seqs, vocab_size]
    generators: list[torch.Generator | None],
) -> torch.Tensor:                                 # [num_seqs, vocab_size], i.i.d. Exp(1) > 0
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        # One draw from the global RNG for the whole batch; seeded rows are overwritten below, so
        # their tokens never depend on the global RNG or on the batch.
        noise.exponential_()
    # The only per-row Python loop: each seeded row draws from its own generator.
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    # exponential_ may return exactly 0 on some backends; 0/0 on a removed token would be NaN,
    # and argmax takes NaN as the maximum, so a removed token could be picked.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

"""Sampler (greedy, seeded reproducibility, distribution, logprobs) and SamplingParams validation.

The statistical tests compare empirical frequencies with a reference distribution computed here
independently (plain Python in float64, one rule at a time), not with the sampler's own code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from sparsex.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    compute_topk_logprobs,
    token_logprobs,
)
from sparsex.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

VOCAB = 8
N_DRAWS = 20_000   # per case: tolerance <= 5 * sqrt(.25 / N) = 0.018
# Distinct probabilities, deliberately *not* sorted by token id, so a sampler that forgets to map
# sorted positions back to token ids picks the wrong tokens. Sorted: .30 .20 .15 .12 .10 .07 .04 .02
BASE_PROBS = [0.10, 0.30, 0.02, 0.15, 0.07, 0.20, 0.04, 0.12]
BASE_LOGITS = torch.tensor([math.log(p) for p in BASE_PROBS], dtype=torch.float32)   # [VOCAB]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None] | None = None
) -> SamplerOutput:
    gens = generators if generators is not None else [None] * len(params)
    return Sampler()(logits, SamplingBatch.from_params(params, gens, "cpu"))


# ---------------------------------------------------------------------------------------------
# Reference distribution: temperature -> min_p -> top_k -> top_p (each on the renormalised
# survivors of the previous step), written as directly as possible.

def _reference(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    scaled = [l / temperature for l in logits]
    m = max(scaled)
    w = [math.exp(s - m) for s in scaled]
    p = [x / sum(w) for x in w]
    keep = set(range(len(p)))

    def renorm() -> list[float]:
        total = sum(p[i] for i in keep)
        return [p[i] / total if i in keep else 0.0 for i in range(len(p))]

    if min_p > 0:
        keep = {i for i in keep if p[i] >= min_p * max(p)}
        p = renorm()
    if top_k > 0:
        keep = set(sorted(keep, key=lambda i: -p[i])[:top_k])
        p = renorm()
    if top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(keep, key=lambda i: -p[i]):
            kept.add(i)
            mass += p[i]
            if mass >= top_p:
                break
        keep = kept
        p = renorm()
    return p


@dataclass
class _Case:
    name: str
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # How many tokens the case must keep: pins the reference itself, so a wrong reference cannot
    # silently agree with a wrong sampler. Thresholds are chosen away from float ties.
    expect_kept: int = VOCAB


CASES = [
    _Case("plain"),
    _Case("temperature_0.5", temperature=0.5),
    _Case("temperature_2", temperature=2.0),
    _Case("top_k_3", top_k=3, expect_kept=3),
    _Case("top_k_beyond_int64", top_k=2**70),                # larger than the vocabulary: keeps all
    _Case("top_p_0.6", top_p=0.6, expect_kept=3),           # cum .30 .50 .65
    _Case("top_p_0.01", top_p=0.01, expect_kept=1),         # only the top token
    _Case("min_p_0.3", min_p=0.3, expect_kept=5),           # keep p >= .09
    _Case("min_p_0.45", min_p=0.45, expect_kept=3),         # keep p >= .135
    # top_p applies to the top-k renormalised survivors: .30/.65=.46, .20/.65=.31 -> cum .77 >= .7
    # keeps 2 (top_p on the full distribution would keep 4, then top_k 3).
    _Case("top_k_3_top_p_0.7", top_k=3, top_p=0.7, expect_kept=2),
    # T=0.7, top-5 renormalised cum .41 .65 .80 .91 1.0 -> top_p .75 keeps 3
    _Case("temp_0.7_top_k_5_top_p_0.75", temperature=0.7, top_k=5, top_p=0.75, expect_kept=3),
    # T=1.5 probs .237 .181 .149 .129 .114 .090 .062 .039; min_p .2 -> p >= .047 keeps 7;
    # renormalised cum ... .84 .94 -> top_p .9 keeps 6
    _Case("temp_1.5_min_p_0.2_top_p_0.9", temperature=1.5, min_p=0.2, top_p=0.9, expect_kept=6),
    _Case("min_p_0.3_top_k_4", min_p=0.3, top_k=4, expect_kept=4),
]


def _check_frequencies(counts: torch.Tensor, expected: list[float], n: int, what: str) -> None:
    """Each token's count is Binomial(n, p): allow 5 standard deviations per token.

    With 8 tokens the chance of a false failure is < 8 * 6e-7, and the draws are seeded anyway so
    the test is deterministic. For n = 20000 the bound is at most 5 * sqrt(.25 / 20000) = 0.018.
    Tokens outside the kept set (p = 0) must never appear at all.
    """
    freq = counts.double() / n
    for tok, p in enumerate(expected):
        if p == 0.0:
            assert counts[tok] == 0, f"{what}: removed token {tok} sampled {int(counts[tok])} times"
        else:
            bound = _tolerance(p, n)
            assert abs(freq[tok].item() - p) <= bound, (
                f"{what}: token {tok} frequency {freq[tok].item():.4f}, expected {p:.4f} +- {bound:.4f}"
            )


def _tolerance(p: float, n: int) -> float:
    return 5 * math.sqrt(p * (1 - p) / n)


def test_reference_cases_keep_expected_set_and_are_detectable():
    """Guards the statistical test against being vacuous: with N_DRAWS draws, an off-by-one in any
    truncation (one kept token too few or too many) or an ignored temperature must fail it."""
    plain = _reference(BASE_LOGITS.tolist(), 1.0, 0, 1.0, 0.0)
    for case in CASES:
        ref = _reference(BASE_LOGITS.tolist(), case.temperature, case.top_k, case.top_p, case.min_p)
        assert sum(p > 0 for p in ref) == case.expect_kept, case.name
        assert math.isclose(sum(ref), 1.0)
        if case.expect_kept == VOCAB:
            if case.temperature != 1.0:      # an ignored temperature must be visible
                diff = max(abs(a - b) for a, b in zip(ref, plain))
                assert diff > 3 * max(_tolerance(p, N_DRAWS) for p in ref), case.name
            continue
        # Dropping any kept token: its count would be 0, far outside its tolerance.
        assert all(p > 3 * _tolerance(p, N_DRAWS) for p in ref if p > 0), case.name
        # Keeping the most likely removed token: it would appear many times instead of never.
        untruncated = _reference(BASE_LOGITS.tolist(), case.temperature, 0, 1.0, 0.0)
        next_removed = max(q for q, p in zip(untruncated, ref) if p == 0)
        assert next_removed * N_DRAWS > 100, case.name



def test_empirical_distribution_matches_reference_all_cases_in_one_batch():
    # One batch holds N_DRAWS identical rows of every case, so this also checks that per-row knobs
    # do not leak between rows of a mixed batch. Unseeded rows: the global RNG, seeded here.
    torch.manual_seed(1234)
    params = [
        p
        for c in CASES
        for p in [SamplingParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, min_p=c.min_p)] * N_DRAWS
    ]
    logits = BASE_LOGITS.expand(len(params), VOCAB).contiguous()    # [len(CASES) * N_DRAWS, VOCAB]
    tokens = _sample(logits, params).sampled_token_ids.view(len(CASES), N_DRAWS)
    for case, row_tokens in zip(CASES, tokens):
        ref = _reference(BASE_LOGITS.tolist(), case.temperature, case.top_k, case.top_p, case.min_p)
        _check_frequencies(torch.bincount(row_tokens, minlength=VOCAB), ref, N_DRAWS, case.name)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("plain", "top_k_3_top_p_0.7", "min_p_0.3")],
                         ids=lambda c: c.name)
def test_empirical_distribution_with_per_row_generators(case):
    # Every row owns a generator seeded differently: the seeded path must sample the same law.
    n = 10_000
    params = [SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                             min_p=case.min_p, seed=s) for s in range(n)]
    gens = [_gen(s) for s in range(n)]
    tokens = _sample(BASE_LOGITS.expand(n, VOCAB), params, gens).sampled_token_ids
    ref = _reference(BASE_LOGITS.tolist(), case.temperature, case.top_k, case.top_p, case.min_p)
    _check_frequencies(torch.bincount(tokens, minlength=VOCAB), ref, n, case.name)


def test_removed_tokens_never_sampled_large_vocab():
    # A wider vocabulary: ids outside the top_k / top_p / min_p sets must never come out.
    torch.manual_seed(0)
    vocab, n = 1000, 2000
    row = torch.randn(vocab) * 2                                    # [vocab]
    logits = row.expand(n, vocab)
    probs = row.softmax(-1)
    top5 = set(row.topk(5).indices.tolist())
    out = _sample(logits, [SamplingParams(top_k=5)] * n).sampled_token_ids
    assert set(out.tolist()) <= top5
    out = _sample(logits, [SamplingParams(min_p=0.2)] * n).sampled_token_ids
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert set(out.tolist()) <= allowed and len(allowed) < vocab
    sorted_p, sorted_ids = probs.sort(descending=True)
    n_keep = int((sorted_p.cumsum(0) < 0.5).sum()) + 1
    out = _sample(logits, [SamplingParams(top_p=0.5)] * n).sampled_token_ids
    assert set(out.tolist()) <= set(sorted_ids[:n_keep].tolist())
    assert len(set(out.tolist())) > 1                                # really sampling, not argmax


# ---------------------------------------------------------------------------------------------
# Greedy

def test_all_greedy_is_argmax_with_lowest_id_on_ties():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0              # tie: id 7 must win
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1)] * 6
    out = _sample(logits, params)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids[2] == 7


def test_greedy_rows_in_mixed_batch_are_argmax():
    # Nearly flat logits: a greedy row that was sampled instead would miss argmax w.h.p.
    torch.manual_seed(0)
    num_seqs, vocab = 16, 200
    logits = torch.randn(num_seqs, vocab) * 0.1
    greedy_rows = set(range(0, num_seqs, 2))
    params = [
        # temperature 1e-6 < eps counts as greedy too; knobs on greedy rows are ignored
        SamplingParams(temperature=(0.0 if i % 4 == 0 else 1e-6), top_p=0.3, top_k=50)
        if i in greedy_rows else SamplingParams(temperature=5.0)
        for i in range(num_seqs)
    ]
    mismatched_random_rows = 0
    for _ in range(5):
        ids = _sample(logits, params).sampled_token_ids
        for i in range(num_seqs):
            if i in greedy_rows:
                assert ids[i] == logits[i].argmax(), f"greedy row {i}"
            else:
                mismatched_random_rows += int(ids[i] != logits[i].argmax())
    assert mismatched_random_rows > 0     # the non-greedy rows really were sampled


def test_top_k_1_and_tiny_top_p_are_deterministic():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=3.0, top_k=1)] * 4 + [SamplingParams(temperature=3.0, top_p=1e-4)] * 4
    assert torch.equal(_sample(logits, params).sampled_token_ids, logits.argmax(-1))


def test_input_logits_not_modified_and_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=10, top_p=0.8, min_p=0.05, logprobs=3)] * 4
    _sample(logits, params)
    assert torch.equal(logits, before)
    out = _sample(logits.to(torch.bfloat16), [SamplingParams(temperature=0.0, logprobs=2)] * 4)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_logprobs.dtype == torch.float32 and out.topk_logprobs.dtype == torch.float32
    assert torch.equal(out.sampled_token_ids, logits.to(torch.bfloat16).float().argmax(-1))


# ---------------------------------------------------------------------------------------------
# Seeded reproducibility

VOCAB_R = 500


def _seeded_run(seed: int, steps: int, others: list[SamplingParams], position: int,
                params: SamplingParams | None = None) -> list[int]:
    """Tokens of one seeded row over `steps` steps, sampled inside a batch of `others`."""
    params = params or SamplingParams(temperature=1.3, top_k=200, top_p=0.95, seed=seed)
    gen = _gen(seed)
    other_gens = [_gen(1000 + j) if p.seed is not None else None for j, p in enumerate(others)]
    own_logits = torch.Generator().manual_seed(42)      # our row sees the same logits every run
    other_logits = torch.Generator().manual_seed(43)
    tokens = []
    for _ in range(steps):
        batch_params = others[:position] + [params] + others[position:]
        gens = other_gens[:position] + [gen] + other_gens[position:]
        rows = [torch.randn(VOCAB_R, generator=other_logits) for _ in others]
        rows.insert(position, torch.randn(VOCAB_R, generator=own_logits))
        logits = torch.stack(rows)                       # [len(others) + 1, VOCAB_R]
        out = _sample(logits, batch_params, gens)
        tokens.append(int(out.sampled_token_ids[position]))
    return tokens


def test_same_seed_same_tokens():
    a = _seeded_run(7, 30, [], 0)
    b = _seeded_run(7, 30, [], 0)
    assert a == b


def test_seeded_row_independent_of_batch():
    alone = _seeded_run(7, 30, [], 0)
    mixes = [
        ([SamplingParams(temperature=0.0)], 1),
        ([SamplingParams(), SamplingParams(top_k=3)], 2),                         # unseeded neighbours
        ([SamplingParams(seed=99), SamplingParams(min_p=0.2, logprobs=5)] * 3, 4),
        ([SamplingParams(temperature=0.0)] * 5, 0),                               # neighbours all greedy
    ]
    for others, position in mixes:
        torch.manual_seed(len(others))          # a different global RNG state each time
        assert _seeded_run(7, 30, others, position) == alone, (len(others), position)


def test_seeded_row_without_filters_independent_of_neighbours_filters():
    # Our row uses no top_k/top_p/min_p; a neighbour that needs the sort/mask path must not
    # change how our row is sampled.
    plain = SamplingParams(temperature=1.0, seed=5)
    alone = _seeded_run(5, 30, [], 0, plain)
    with_filters = _seeded_run(5, 30, [SamplingParams(top_k=4, top_p=0.5, min_p=0.1)], 0, plain)
    assert alone == with_filters


def test_different_seeds_differ():
    a = _seeded_run(1, 40, [], 0)
    b = _seeded_run(2, 40, [], 0)
    # Over 40 draws from a broad distribution, two independent streams agree on only a few.
    assert sum(x == y for x, y in zip(a, b)) < 10


def test_seeded_request_needs_generator():
    with pytest.raises(ValueError, match="seed=3"):
        SamplingBatch.from_params([SamplingParams(seed=3)], [None], "cpu")
    with pytest.raises(ValueError, match="len\\(generators\\)=2"):
        SamplingBatch.from_params([SamplingParams()], [None, None], "cpu")


def test_from_params_fields():
    params = [
        SamplingParams(temperature=0.0, top_k=5, logprobs=2),
        SamplingParams(temperature=0.8, top_k=-1, top_p=0.9, logprobs=4),
        SamplingParams(temperature=1e-7, min_p=0.3),
    ]
    b = SamplingBatch.from_params(params, [None] * 3, "cpu")
    assert b.temperature.tolist() == pytest.approx([0.0, 0.8, 0.0])
    assert b.top_k.dtype == torch.int64 and b.top_k.tolist() == [5, 0, 0]
    assert b.max_num_logprobs == 4 and not b.all_greedy
    # Only the non-greedy row counts for the skip hints: it uses top_p, nothing else.
    assert (b.no_top_k, b.no_top_p, b.no_min_p) == (True, False, True)
    b = SamplingBatch.from_params(params[:1] + params[2:], [None] * 2, "cpu")
    assert b.all_greedy and b.max_num_logprobs == 2
    assert SamplingBatch.from_params([SamplingParams()], [None], "cpu").max_num_logprobs is None


def test_hints_off_gives_same_result():
    # The skip hints are an optimisation only: with them all False the tokens must not change.
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    params = [SamplingParams(temperature=0.9, seed=i) for i in range(4)] + [SamplingParams(temperature=0.0)]
    fast = SamplingBatch.from_params(params, [_gen(i) for i in range(4)] + [None], "cpu")
    assert fast.no_top_k and fast.no_top_p and fast.no_min_p
    slow = SamplingBatch.from_params(params, [_gen(i) for i in range(4)] + [None], "cpu")
    slow.no_top_k = slow.no_top_p = slow.no_min_p = False
    for _ in range(10):
        assert torch.equal(Sampler()(logits, fast).sampled_token_ids, Sampler()(logits, slow).sampled_token_ids)


# ---------------------------------------------------------------------------------------------
# Logprobs

def test_logprobs_are_raw_model_distribution():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    params = [SamplingParams(temperature=0.5, top_k=10, logprobs=5)] * 3 + [SamplingParams(temperature=0.0, logprobs=2)] * 3
    out = _sample(logits, params)
    ref = torch.log_softmax(logits.double(), dim=-1)                 # [6, 40]
    ids = out.sampled_token_ids
    torch.testing.assert_close(out.sampled_logprobs.double(), ref.gather(1, ids[:, None]).squeeze(1),
                               rtol=0, atol=1e-5)
    # Not the temperature-scaled distribution (the two differ a lot at T=0.5).
    scaled = torch.log_softmax(logits.double() / 0.5, dim=-1).gather(1, ids[:3, None]).squeeze(1)
    assert (out.sampled_logprobs[:3].double() - scaled).abs().max() > 0.1

    assert out.topk_token_ids.shape == (6, 5) and out.topk_logprobs.shape == (6, 5)
    assert torch.all(out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:])          # descending
    exp_vals, exp_ids = ref.topk(5, dim=-1)
    assert torch.equal(out.topk_token_ids, exp_ids)
    torch.testing.assert_close(out.topk_logprobs.double(), exp_vals, rtol=0, atol=1e-5)


def test_no_logprobs_requested_and_zero_logprobs():
    logits = torch.randn(2, 10)
    out = _sample(logits, [SamplingParams()] * 2)
    assert out.sampled_logprobs is None and out.topk_token_ids is None and out.topk_logprobs is None
    # logprobs=0: only the sampled token's logprob, an empty top-k.
    out = _sample(logits, [SamplingParams(logprobs=0), SamplingParams()])
    assert out.sampled_logprobs.shape == (2,)
    assert out.topk_token_ids.shape == (2, 0) and out.topk_logprobs.shape == (2, 0)


def test_compute_topk_and_token_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(7, 30, dtype=torch.float16)
    ref = torch.log_softmax(logits.double(), dim=-1)
    ids, lps = compute_topk_logprobs(logits, 4)
    assert ids.shape == (7, 4) and lps.dtype == torch.float32
    torch.testing.assert_close(lps.double(), ref.gather(1, ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(lps.double(), ref.topk(4, dim=-1).values, rtol=0, atol=1e-5)
    tok = torch.tensor([0, 5, 29, 3, 3, 1, 17])
    torch.testing.assert_close(token_logprobs(logits, tok).double(), ref[torch.arange(7), tok], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="31"):
        compute_topk_logprobs(logits, 31)
    with pytest.raises(ValueError, match="-1"):
        compute_topk_logprobs(logits, -1)
    with pytest.raises(ValueError):
        token_logprobs(logits, tok[:3])


def test_sampler_rejects_shape_mismatch():
    batch = SamplingBatch.from_params([SamplingParams()] * 2, [None] * 2, "cpu")
    with pytest.raises(ValueError, match="num_seqs=2"):
        Sampler()(torch.randn(3, 10), batch)


# ---------------------------------------------------------------------------------------------
# SamplingParams

@pytest.mark.parametrize(
    "kwargs, shown",
    [
        ({"temperature": -0.1}, "-0.1"),
        ({"temperature": float("nan")}, "nan"),
        ({"top_p": 0.0}, "0.0"),
        ({"top_p": 1.5}, "1.5"),
        ({"max_tokens": 0}, "0"),
        ({"top_k": -2}, "-2"),
        ({"top_k": 2.5}, "2.5"),
        ({"min_p": 1.2}, "1.2"),
        ({"logprobs": -1}, "-1"),
        ({"logprobs": 21}, "21"),
        ({"logprobs": "3"}, "'3'"),
        ({"prompt_logprobs": 99}, "99"),
        ({"n": 0}, "0"),
        ({"n": True}, "True"),
        ({"seed": 1.5}, "1.5"),
        ({"stop": [""]}, "''"),
        ({"stop": 5}, "5"),
        ({"stop_token_ids": [-1]}, "-1"),
    ],
)
def test_sampling_params_rejects(kwargs, shown):
    name = next(iter(kwargs))
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert name in msg and shown in msg, msg


def test_sampling_params_normalises():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=(2, 3))
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == [2, 3]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    p = SamplingParams(temperature=0, top_p=1, max_tokens=None, logprobs=20)   # boundaries accepted
    assert p.max_tokens is None and p.logprobs == 20

"""The engine on CUDA (skipped without a GPU): SmolLM2 fp32 greedy tokens equal transformers' and the
CPU path's; CUDA-graph decode gives the eager tokens; every cache policy runs and keeps the block
pool consistent. Timings live in benchmarks/gpu_engine.py, not here."""
from __future__ import annotations

import json
import os

import pytest
import torch

from sparsex import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.model,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DATA = os.path.join(os.path.dirname(__file__), "data", "smollm2_greedy_cpu.json")


@pytest.fixture(scope="module")
def cpu_greedy() -> dict:
    with open(DATA) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def gpu_llm():
    return LLM(device="cuda", dtype="float32", cache="prefix", seed=0)


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_greedy_matches_cpu_path_and_transformers(gpu_llm, cpu_greedy):
    from transformers import AutoModelForCausalLM
    from sparsex.models.loader import load_model

    cases, n = cpu_greedy["cases"], cpu_greedy["max_tokens"]
    got = _greedy(gpu_llm, [c["prompt_token_ids"] for c in cases], n)
    assert got == [c["greedy"] for c in cases]
    hf = AutoModelForCausalLM.from_pretrained(load_model("smollm2-135m-instruct").model_dir, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    with torch.inference_mode():
        for c, g in zip(cases, got):
            ids = torch.tensor([c["prompt_token_ids"]], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
            assert g == ref, f"prompt of {ids.shape[1]} tokens diverges from transformers"
    gpu_llm.llm_engine.check_integrity()


def test_cuda_graph_decode_matches_eager(gpu_llm, cpu_greedy):
    runner = gpu_llm.llm_engine.runner
    prompts = [c["prompt_token_ids"] for c in cpu_greedy["cases"]]
    for batch in (prompts[:1], prompts[:3], prompts):          # graph sizes 1, 4 (padded), 8 (padded)
        gpu_llm.reset_cache()
        gpu_llm.llm_engine.config.enforce_eager = True
        eager = _greedy(gpu_llm, batch, 20)
        gpu_llm.reset_cache()
        gpu_llm.llm_engine.config.enforce_eager = False
        graphed = _greedy(gpu_llm, batch, 20)
        assert graphed == eager
    assert runner.decode_graphs is not None and len(runner.decode_graphs.graphs) > 0
    gpu_llm.llm_engine.check_integrity()


def test_sampled_decode_with_graphs_is_seeded(gpu_llm, cpu_greedy):
    p = cpu_greedy["cases"][2]["prompt_token_ids"]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=7, logprobs=2)
    a, b = (gpu_llm.generate([{"prompt_token_ids": p}] * 2, params, use_tqdm=False) for _ in range(2))
    toks = lambda outs: [o.outputs[0].token_ids for o in outs]
    assert toks(a) == toks(b)
    assert all(len(lp) >= 1 for lp in a[0].outputs[0].logprobs)


@pytest.mark.parametrize("cache", ["none", "prefix", "sparsex"])
def test_every_cache_policy_runs(cache, cpu_greedy):
    llm = LLM(device="cuda", dtype="float32", cache=cache, seed=0, kv_cache_memory=1 << 28)
    long = cpu_greedy["cases"][-1]["prompt_token_ids"]
    sys_ids, question = long[:24], long[-40:]
    passages = [long[24 + i * 160: 24 + (i + 1) * 160] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate({"segments": [sys_ids, *passages, question]}, params, use_tqdm=False)[0]
    # the same passages in another order, two requests at once (a batch of two decodes)
    again = [{"segments": [sys_ids, *passages[r:], *passages[:r], question]} for r in (1, 2)]
    outs = llm.generate(again, params, use_tqdm=False)
    assert len(first.outputs[0].token_ids) == 8 and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    if cache == "sparsex":
        assert all(o.num_reused_tokens > 0 for o in outs)
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("rescore_layers", [0, 2, None])   # None: the default (two stages)
def test_cuda_selection_scores_equal_the_torch_selectors(cpu_greedy, rescore_layers, monkeypatch):
    """A blended step's CUDA scores (triton_probe: the deviation before the layer's K/V store, the query
    mass from the paged cache after it) equal the torch selectors' on the same step's tensors, at
    both stages of a two-stage selection (two full layers: the probes at layers 1 and 3)."""
    from sparsex.segment import selectors
    from sparsex.segment.step_blend import StepBlend
    llm = LLM(device="cuda", dtype="float32", cache="sparsex", seed=0, kv_cache_memory=1 << 28, full_layers=2)
    long = cpu_greedy["cases"][-1]["prompt_token_ids"]
    sys_ids, question = long[:24], long[-40:]
    passages = [long[24 + i * 160: 24 + (i + 1) * 160] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate({"segments": [sys_ids, *passages, question]}, params, use_tqdm=False)
    probe, finish, checked = StepBlend._probe, StepBlend._finish_sparse_q, []

    def checked_probe(blend, layer_idx, q, k, v, k_cache, v_cache, ctx):
        probe(blend, layer_idx, q, k, v, k_cache, v_cache, ctx)
        md = ctx.attn_metadata
        for b in blend._seqs:
            if b.layer == layer_idx:
                cur = blend._current_rows(ctx, b.reused_rows)
                slots = md.slot_mapping[cur]
                ref = selectors.kv_deviation_scores(k[cur], v[cur], k_cache.view(-1, *k_cache.shape[2:])[slots],
                                                    v_cache.view(-1, *v_cache.shape[2:])[slots])
                assert b.pending is not None and torch.allclose(b.pending[0], ref, rtol=1e-4, atol=1e-4)

    def checked_finish(blend, b, layer_idx, ctx):
        dev, q = b.pending
        out = finish(blend, b, layer_idx, ctx)
        md, si = ctx.attn_metadata, b.seq_index
        k_cache = ctx.kv_caches[layer_idx][0]
        n, bs = md.seq_lens_cpu[si], k_cache.shape[1]
        keys = k_cache[md.block_tables[si, :(n + bs - 1) // bs].long()].flatten(0, 1)[:n]   # fresh K stored
        rows = blend._current_rows(ctx, b.query_rows)
        imp = selectors.query_attention_mass(q[rows], keys, md.positions[rows], q.shape[-1] ** -0.5)[b.reused_pos]
        ref = dev * (1.0 + imp / imp.mean())                                  # selectors.sparse_q_scores, by hand
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2
        checked.append(layer_idx)
        return out
    monkeypatch.setattr(StepBlend, "_probe", checked_probe)
    monkeypatch.setattr(StepBlend, "_finish_sparse_q", checked_finish)
    reuse = None if rescore_layers is None else {"rescore_layers": rescore_layers, "candidate_ratio": 0.5}
    out = llm.generate({"segments": [sys_ids, *passages[2:], *passages[:2], question]}, params,
                       use_tqdm=False, reuse=reuse)[0]
    assert out.num_reused_tokens > 0
    assert checked == ([1] if rescore_layers == 0 else [1, 3])
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("selector", ["query_fused", "chunk_anchor"])
def test_cuda_query_selectors_equal_the_torch_reference(cpu_greedy, selector, monkeypatch):
    """The query selectors on CUDA: at each fused layer (1..F-1) the query mass `triton_probe.query_key_mass`
    adds equals the torch selector's over the keys the probe stored; the kept count is the host's; at
    recompute_ratio=1 the greedy tokens are plain prefill's."""
    from sparsex.config import ReuseConfig
    from sparsex.segment import selectors
    from sparsex.segment.step_blend import StepBlend, query_layers
    llm = LLM(device="cuda", dtype="float32", cache="sparsex", seed=0, kv_cache_memory=1 << 28)
    long = cpu_greedy["cases"][-1]["prompt_token_ids"]
    sys_ids, question = long[:24], long[-40:]
    passages = [long[24 + i * 160: 24 + (i + 1) * 160] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate({"segments": [sys_ids, *passages, question]}, params, use_tqdm=False)
    probe_query, checked = StepBlend._probe_query, []

    def checked_probe_query(blend, seqs, layer_idx, q, k, v, k_cache, v_cache, ctx):
        before = [None if b.query_mass is None else b.query_mass.clone() for b in seqs]
        probe_query(blend, seqs, layer_idx, q, k, v, k_cache, v_cache, ctx)
        md = ctx.attn_metadata
        for b, prev in zip(seqs, before):
            si = b.seq_index
            n, bs = md.seq_lens_cpu[si], k_cache.shape[1]
            keys = k_cache[md.block_tables[si, :(n + bs - 1) // bs].long()].flatten(0, 1)[:n]   # fresh K stored
            rows = blend._current_rows(ctx, b.query_rows)
            want = selectors.query_attention_mass(q[rows], keys, md.positions[rows], q.shape[-1] ** -0.5)[b.reused_pos]
            got = (b.query_mass - (0 if prev is None else prev)) * len(query_layers(b.reuse))
            assert ((got - want).norm() / want.norm()).item() < 1e-2, layer_idx
        checked.append(layer_idx)
    monkeypatch.setattr(StepBlend, "_probe_query", checked_probe_query)
    second = {"segments": [sys_ids, *passages[2:], *passages[:2], question]}
    out = llm.generate(second, params, use_tqdm=False, reuse={"selector": selector, "approx_prefix": False})[0]
    n = out.num_reused_tokens
    assert n > 0 and out.num_recomputed_tokens == round(0.125 * n)
    assert checked == list(query_layers(ReuseConfig(selector=selector)))
    full = llm.generate(second, params, use_tqdm=False,
                        reuse={"selector": selector, "recompute_ratio": 1.0, "approx_prefix": False})[0]
    assert full.num_recomputed_tokens == full.num_reused_tokens > 0            # its question is indexed now too
    plain = LLM(device="cuda", dtype="float32", cache="none", seed=0, kv_cache_memory=1 << 28)
    assert full.outputs[0].token_ids == plain.generate(second, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.check_integrity()

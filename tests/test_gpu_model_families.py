"""Every supported family on CUDA (skipped without a GPU): the Triton kernels with sliding windows,
per-layer RoPE bases and partial rotary, the MoE path, CUDA-graph decode.

Per family, the tiny random-weight model of tests/test_model_families.py: fp32 greedy tokens equal
transformers' (CPU, fp32) and CUDA-graph decode gives the eager tokens; `selector="all"` equals plain
prefill on the GPU; bf16 agrees with fp32 on most teacher-forced top-1 tokens. fp32 attention runs
its dots in tf32 on the tensor cores (triton_attention._DOT_PRECISION), hence the logprob tolerance.
"""
from __future__ import annotations

import pytest
import torch

from sparsex import LLM, SamplingParams
from sparsex.bench.fidelity import pieces_prompt, run_to_completion
from test_hf_parity import _hf_greedy
from test_model_families import FAMILIES, build_family

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
ONE = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, smollm2):
    """(name, HF directory, transformers reference model on the CPU)."""
    name = request.param
    path = tmp_path_factory.mktemp(f"gpu-{name}")
    return name, str(path), build_family(name, smollm2.tokenizer, path)


@pytest.fixture(scope="module")
def prompts(smollm2, wiki_texts):
    tok = smollm2.tokenizer
    texts = ["The capital of France is", wiki_texts[0][:500], " ".join(wiki_texts[1:3])[:1400]]
    return [tok.encode(t) for t in texts]                 # ~6, ~110, ~300 tokens: past every window


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_fp32_greedy_matches_transformers_with_and_without_cuda_graphs(family, prompts, monkeypatch):
    name, path, ref = family
    if name == "phi3":
        prompts = [p for p in prompts if len(p) > 32]        # LongRoPE: long factors on both sides
    graphs = LLM(model=path, device="cuda", dtype="float32", cache="prefix")
    assert not graphs.llm_engine.runner.enforce_eager
    outs = _generate(graphs, prompts, GREEDY)
    for p, o in zip(prompts, outs):
        ref_ids, ref_lps = _hf_greedy(ref, p, GREEDY.max_tokens)
        got = o.outputs[0]
        assert got.token_ids == ref_ids, f"{name}: prompt of {len(p)} tokens diverges on CUDA"
        ours = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 2e-2, name
    # a second pass hits the prefix cache and gives the same tokens
    again = _generate(graphs, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert sum(o.num_cached_tokens for o in again) > 0
    graphs.llm_engine.check_integrity()
    del graphs
    monkeypatch.setenv("SPARSEX_ENFORCE_EAGER", "1")
    eager = LLM(model=path, device="cuda", dtype="float32", cache="none")
    assert eager.llm_engine.runner.enforce_eager
    assert [o.outputs[0].token_ids for o in _generate(eager, prompts, GREEDY)] == \
        [o.outputs[0].token_ids for o in outs], f"{name}: CUDA-graph decode differs from eager"


def test_selector_all_equals_plain_prefill_on_cuda(family, wiki_texts):
    name, path, _ = family
    sx = LLM(model=path, device="cuda", cache="sparsex", dtype="float32", min_blend_tokens=0,
             transparent_segments=False)
    full = LLM(model=path, device="cuda", cache="none", dtype="float32")
    eng, ref = sx.llm_engine, full.llm_engine
    passages = [t[:500] for t in wiki_texts[20:23]]
    question = "\nQuestion: which passage above is the oldest? Answer:"
    run_to_completion(eng, pieces_prompt(eng, ["System: answer from the passages.\n\n", *passages, question],
                                         [True] * 4 + [False]), ONE)
    p = pieces_prompt(eng, ["Another system prompt.\n", *passages[::-1], question], [True] * 4 + [False])
    n = len(p.token_ids)

    def tail(engine, reuse=None):
        out, dist = run_to_completion(engine, p, ONE, reuse=reuse, distributions_from=n - 8)
        return out, torch.stack([dist[i].float().cpu() for i in range(n - 8, n)])

    _, want = tail(ref)
    out, naive = tail(eng, {"selector": "none"})
    assert out.num_reused_tokens > 200 and out.num_recomputed_tokens == 0, name
    assert ((naive - want).norm() / want.norm()).item() > 1e-3, name
    out, got = tail(eng, {"selector": "all"})
    assert out.num_recomputed_tokens == out.num_reused_tokens > 200, name
    assert ((got - want).norm() / want.norm()).item() < 1e-3, name
    eng.check_integrity()


def test_bf16_agrees_with_fp32_on_teacher_forced_top1(family, prompts):
    name, path, _ = family
    ids = prompts[2]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)   # its token + the top-1
    top = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=path, device="cuda", dtype=dtype, cache="none")
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        top[dtype] = [max(lp, key=lp.get) for lp in out.prompt_logprobs[1:]]
        del llm
    agree = sum(a == b for a, b in zip(top["float32"], top["bfloat16"])) / len(top["float32"])
    assert agree >= 0.8, (name, agree)

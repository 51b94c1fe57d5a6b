"""Tensor parallelism on the CPU (gloo, 2 ranks: rank 0 in this process, rank 1 a process of its own).

The reference is the same engine with tensor_parallel_size=1: greedy tokens equal and logprobs within
fp32 tolerance on a tiny random model of every family (heads, KV heads, MLP and experts split in
two; vocabulary split with padding) and on the real Qwen2.5-Coder-0.5B (2 KV heads, 14 heads);
blended requests keep the same rows on both ranks (checked on every selection) and match TP=1;
`selector="all"` equals plain prefill. A rank that dies or hangs ends the request with an error,
never a hang. The pieces (which rank holds what, the checkpoint cut, the step message) are unit-tested.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from sparsex import LLM, SamplingParams
from sparsex.bench.fidelity import pieces_prompt, run_to_completion
from sparsex.config import EngineConfig
from sparsex.engine.tp_executor import TensorParallelError
from sparsex.engine.tp_step import StepMessageBuilder, StepMirror
from sparsex.engine.scheduler import ScheduledRequest, SchedulerOutput
from sparsex.layers.tensor_parallel import TensorParallelGroup, check_divisible
from sparsex.models.model_config import ModelConfig
from sparsex.models.shapes import param_shapes
from sparsex.models.weight_sharding import local_config, shard_hf_weights
from test_loader import _qwen_installed
from test_model_families import FAMILIES, build_family

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
ONE = SamplingParams(temperature=0.0, max_tokens=1)
POOL = 256


# ---- unit: which rank holds what ---------------------------------------------------------------

@pytest.mark.unit
def test_ranges_cover_every_head_and_vocabulary_row_once():
    ranks = [TensorParallelGroup(r, 4) for r in range(4)]
    assert [g.head_range(32) for g in ranks] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [g.kv_head_range(8) for g in ranks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # fewer KV heads than ranks: each is replicated, and a rank's query heads all read the one it holds
    assert [g.kv_head_range(2) for g in ranks] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert ranks[0].kv_replication(2) == 2 and ranks[0].kv_replication(8) == 1
    for g in ranks:
        q0, q1 = g.head_range(32)
        k0, k1 = g.kv_head_range(2)
        assert {h // 16 for h in range(q0, q1)} == set(range(k0, k1))    # GQA group of 16 query heads
    # 49,155 rows: the last rank's range runs past the vocabulary (padded)
    assert [g.vocab_range(49155) for g in ranks][-1] == (36867, 49156)


@pytest.mark.unit
def test_a_size_that_does_not_divide_the_model_is_refused_naming_the_dimension():
    check_divisible(14, 2, 4864, 0, 2)                                 # Qwen2.5-0.5B on two ranks
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        check_divisible(9, 3, 1536, 0, 2)                              # SmolLM2-135M
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_divisible(12, 3, 1536, 0, 2)
    with pytest.raises(ValueError, match="moe_intermediate_size=33"):
        check_divisible(4, 2, 128, 33, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not support segment_store"):
        EngineConfig(tensor_parallel_size=2, segment_store="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="device='cuda'"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1")


def _tiny(arch: str, **kw) -> ModelConfig:
    hf = dict(model_type=arch, vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
              max_position_embeddings=64, tie_word_embeddings=False, **kw)
    return ModelConfig.from_hf_config(hf)


@pytest.mark.unit
@pytest.mark.parametrize("cfg", [
    _tiny("qwen2", attention_bias=True),
    _tiny("phi3"),                                                     # fused qkv_proj / gate_up_proj
    _tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2),
], ids=["qwen2", "phi3", "qwen3_moe", "mixtral"])
def test_the_ranks_shards_put_together_are_the_checkpoint(cfg):
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen) for name, shape in param_shapes(cfg).items()}
    shards = [shard_hf_weights(full, cfg, TensorParallelGroup(r, 2)) for r in range(2)]
    local = local_config(cfg, TensorParallelGroup(0, 2))
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert set(shards[0]) == set(shards[1])
    if cfg.architecture != "phi3":                                     # phi3's fused tensors come back split
        assert set(shards[0]) == set(full)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, w in full.items():
        if name.endswith("qkv_proj.weight"):                           # split into q, k, v by the cut
            base = name[: -len("qkv_proj.weight")]
            for part, rows in zip("qkv", w.split([q, kv, kv])):
                assert torch.equal(torch.cat([s[base + f"{part}_proj.weight"] for s in shards]), rows)
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            for part, rows in zip(("gate", "up"), w.split(cfg.intermediate_size)):
                assert torch.equal(torch.cat([s[base + f"{part}_proj.weight"] for s in shards]), rows)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            got = torch.cat([s[name] for s in shards])
            assert torch.equal(got[:cfg.vocab_size], w) and not got[cfg.vocab_size:].any()    # zero padding
        elif name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):
            assert torch.equal(torch.cat([s[name] for s in shards], dim=1), w), name
        elif shards[0][name].shape == w.shape:                         # norms, routers: whole on every rank
            assert all(s[name] is w for s in shards), name
        else:
            assert torch.equal(torch.cat([s[name] for s in shards]), w), name


class _Req:
    """What the step message reads of a request."""

    def __init__(self, rid: str, prompt: list[int]):
        from sparsex.sampling_params import SamplingParams as SP
        self.request_id, self.prompt_token_ids, self.params = rid, prompt, SP(prompt_logprobs=1)
        self.output_token_ids, self.num_computed_tokens, self.blocks = [], 0, []
        self.query_horizon, self.reuse_record, self.is_finished = None, None, False


class _Block:
    def __init__(self, i: int):
        self.block_id = i


@pytest.mark.unit
def test_the_step_message_carries_only_what_changed_and_the_mirror_follows():
    builder, mirror = StepMessageBuilder(), StepMirror()
    a = _Req("a", list(range(40)))
    a.blocks = [_Block(i) for i in (7, 3, 9)]

    def step(req, n):
        msg = builder.build(SchedulerOutput([ScheduledRequest(req, n)]))
        return msg, mirror.apply(msg).scheduled[0].request

    msg, m = step(a, 40)
    assert msg.requests[0].prompt_token_ids == tuple(range(40)) and msg.requests[0].new_block_ids == (7, 3, 9)
    assert [b.block_id for b in m.blocks] == [7, 3, 9] and m.params.prompt_logprobs == 1
    a.num_computed_tokens, a.output_token_ids = 40, [100]
    a.blocks.append(_Block(4))
    msg, m = step(a, 1)                                    # a decode step: a few integers
    d = msg.requests[0]
    assert d.prompt_token_ids is None and d.new_output_tokens == (100,) and d.new_block_ids == (4,)
    assert m.num_tokens == 41 and [b.block_id for b in m.blocks] == [7, 3, 9, 4]
    a.blocks = [_Block(1), _Block(2)]                      # preempted and readmitted: a new table
    a.num_computed_tokens = 0
    msg, m = step(a, 41)
    assert msg.requests[0].reset_blocks and [b.block_id for b in m.blocks] == [1, 2] and m.num_computed_tokens == 0
    a.is_finished = True
    msg = builder.build(SchedulerOutput())
    assert msg.finished == ("a",)
    mirror.apply(msg)
    assert mirror.requests == {}
    b = _Req("b", [1, 2])
    builder.build(SchedulerOutput([ScheduledRequest(b, 2)]))
    with pytest.raises(RuntimeError, match="never saw"):         # a rank that missed b's first message
        StepMirror().apply(builder.build(SchedulerOutput([ScheduledRequest(b, 1)])))


# ---- model: TP=2 against TP=1 ------------------------------------------------------------------

def _tiny_llama_dir(path, tok, **kw) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    qwen2 = kw.pop("qwen2", False)
    cls, cfg_cls = (Qwen2ForCausalLM, Qwen2Config) if qwen2 else (LlamaForCausalLM, LlamaConfig)
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id or tok.eos_token_id, tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + 1.0) if "norm" in name else p.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=("llama", "llama-one-kv-head", "qwen2") + FAMILIES)
def family_dir(request, tmp_path_factory, smollm2):
    name = request.param
    path = tmp_path_factory.mktemp(name)
    tok = smollm2.tokenizer
    if name == "llama":
        return name, _tiny_llama_dir(path, tok, num_key_value_heads=2)
    if name == "llama-one-kv-head":                    # fewer KV heads than ranks: replicated
        return name, _tiny_llama_dir(path, tok, num_key_value_heads=1)
    if name == "qwen2":
        return name, _tiny_llama_dir(path, tok, num_key_value_heads=2, qwen2=True)
    build_family(name, tok, path)
    return name, str(path)


def _generate(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], outs


def _close(*llms: LLM) -> None:
    for llm in llms:
        llm.llm_engine.close()


@pytest.mark.model
def test_tp2_equals_tp1(family_dir, wiki_texts):
    """Greedy tokens, their logprobs and prompt logprobs (the head's all-gather on chunks of rows)."""
    name, path = family_dir
    prompts = ["The capital of France is", wiki_texts[0][:600]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    one = LLM(model=path, cache="prefix", dtype="float32", num_blocks=POOL)
    want, want_req = _generate(one, prompts, params)
    two = LLM(model=path, cache="prefix", dtype="float32", num_blocks=POOL, tensor_parallel_size=2)
    try:
        assert two.llm_engine.runner.runner.num_kv_heads == (1 if name == "llama-one-kv-head" else
                                                             one.llm_engine.runner.num_kv_heads // 2)
        got, got_req = _generate(two, prompts, params)
        for w, g, wr, gr in zip(want, got, want_req, got_req):
            assert g.token_ids == w.token_ids, name
            lp = [abs(a[t] - b[t]) for a, b, t in zip(w.logprobs, g.logprobs, w.token_ids)]
            assert max(lp) < 1e-4, name
            plp = [abs(a[t] - b[t]) for a, b, t in
                   zip(wr.prompt_logprobs[1:], gr.prompt_logprobs[1:], wr.prompt_token_ids[1:])]
            assert max(plp) < 1e-4, name
        # a second round hits the prefix cache on rank 0's blocks: every rank reads its own shard of them
        again, _ = _generate(two, prompts, params)
        assert [g.token_ids for g in again] == [w.token_ids for w in want]
        two.llm_engine.check_integrity()
    finally:
        _close(one, two)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm2):
    return _tiny_llama_dir(tmp_path_factory.mktemp("llama-blend"), smollm2.tokenizer, num_key_value_heads=2)


def _passages(wiki_texts) -> list[str]:
    return [t[:500] for t in wiki_texts[20:23]]


def _blend_prompts(eng, wiki_texts):
    passages = _passages(wiki_texts)
    question = "\nQuestion: which passage above is the oldest? Answer:"
    first = pieces_prompt(eng, ["System: answer from the passages.\n\n", *passages, question], [True] * 4 + [False])
    second = pieces_prompt(eng, ["Another system prompt.\n", *passages[::-1], question], [True] * 4 + [False])
    return first, second


# ---- failure: a rank that dies or hangs -------------------------------------------------------

@pytest.mark.model
def test_a_rank_that_dies_ends_the_next_step_with_an_error(llama_dir):
    llm = LLM(model=llama_dir, cache="prefix", dtype="float32", num_blocks=POOL, tensor_parallel_size=2)
    try:
        llm.generate(["warm"], ONE, use_tqdm=False)
        worker = llm.llm_engine.runner.workers[0]
        worker.kill()
        worker.wait()
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 exited with code -9"):
            llm.generate(["The capital of France is"], ONE, use_tqdm=False)
        assert time.monotonic() - t0 < 10
    finally:
        _close(llm)


@pytest.mark.model
def test_a_rank_that_hangs_ends_the_step_within_the_timeout(llama_dir):
    llm = LLM(model=llama_dir, cache="prefix", dtype="float32", num_blocks=POOL, tensor_parallel_size=2,
              tp_timeout=3)
    worker = llm.llm_engine.runner.workers[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate(["The capital of France is, in one word,"], ONE, use_tqdm=False)
        assert time.monotonic() - t0 < 20
        assert worker.poll() is not None                       # stopped ranks are killed, not left behind
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
        _close(llm)


@pytest.mark.model
def test_chunked_prefill_preemption_and_prefix_caching_under_tp2_change_nothing(llama_dir, wiki_texts):
    """A pool too small for the batch (preemption by recompute: a request's blocks are replaced, and
    its table is sent again), prompts chunked over steps, and prefix caching on and off: TP=2's greedy
    tokens are TP=1's with prefix caching off."""
    batch = [wiki_texts[i][:500] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLM(model=llama_dir, cache="none", dtype="float32", num_blocks=POOL)
    want = [o.outputs[0].token_ids for o in one.generate(batch, params, use_tqdm=False)]
    _close(one)
    tight = LLM(model=llama_dir, cache="prefix", dtype="float32", num_blocks=24, max_num_batched_tokens=48,
                tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in tight.generate(batch, params, use_tqdm=False)]
        assert tight.llm_engine.scheduler.num_preemptions > 0
        assert got == want
        again = [o.outputs[0].token_ids for o in tight.generate(batch[:2], params, use_tqdm=False)]
        assert again == want[:2]                                  # prefix-cache hits on every rank's shard
        tight.llm_engine.check_integrity()
    finally:
        _close(tight)


@pytest.mark.model
def test_the_host_tier_moves_every_ranks_shard(llama_dir, wiki_texts):
    """Entries evicted from a small pool go to the host tier and come back for a later prompt. Rank 0's
    host tier decides; every other rank spills and installs its own shard with it. Served from the
    loaded KV as is (selector "none"), TP=2 equals TP=1 only if every rank brought back its shard."""
    passages = [t[:700] for t in wiki_texts[20:23]]
    head, q = "System: answer from the passages.\n\n", "\nQuestion: which passage is the oldest? Answer:"
    results = {}
    for tp in (1, 2):
        llm = LLM(model=llama_dir, cache="sparsex", dtype="float32", num_blocks=80, host_kv_cache_memory=64 << 20,
                  min_blend_tokens=0, transparent_segments=False, tensor_parallel_size=tp)
        try:
            eng = llm.llm_engine
            run_to_completion(eng, pieces_prompt(eng, [head, *passages, q], [True] * 4 + [False]), ONE)
            # an unrelated long prompt fills the pool: the passages' entries are evicted into host memory
            run_to_completion(eng, pieces_prompt(eng, [" ".join(wiki_texts[30:36])[:4500]], [False]), ONE)
            assert eng.stats().store.host_bytes_in > 0
            p = pieces_prompt(eng, ["Another system prompt, so no prefix hit.\n", *passages[::-1], q], [True] * 4 + [False])
            n = len(p.token_ids)
            out, dist = run_to_completion(eng, p, GREEDY, reuse={"selector": "none"}, distributions_from=n - 8)
            st = eng.stats().store
            assert st.host_hits >= 1 and st.installed_tokens > 100 and out.num_reused_tokens > 300
            results[tp] = (out.outputs[0].token_ids, torch.stack([dist[i] for i in range(n - 8, n)]))
            eng.check_integrity()
        finally:
            _close(llm)
    assert results[2][0] == results[1][0]
    assert ((results[2][1] - results[1][1]).norm() / results[1][1].norm()).item() < 1e-4


# ---- the real Qwen2.5-Coder-0.5B --------------------------------------------------------------

@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(not _qwen_installed(), reason="optional model not installed: qwen2.5-coder-0.5b-instruct")
def test_qwen_coder_tp2_equals_tp1(wiki_texts):
    prompts = ["def fibonacci(n):", wiki_texts[1][:400]]
    kw = dict(model="qwen2.5-coder-0.5b-instruct", cache="prefix", dtype="float32", num_blocks=64, max_model_len=1024)
    one = LLM(**kw)
    want, _ = _generate(one, prompts, GREEDY)
    _close(one)
    del one
    two = LLM(tensor_parallel_size=2, **kw)
    try:
        got, _ = _generate(two, prompts, GREEDY)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
            assert max(abs(a[t] - b[t]) for a, b, t in zip(w.logprobs, g.logprobs, w.token_ids)) < 1e-3
    finally:
        _close(two)


# ---- the server -------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc: no extra tool)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.model
def test_serve_with_two_ranks_answers_the_openai_client_and_exits_when_a_rank_dies(llama_dir):
    import openai

    from test_server_cli import start_serve

    proc, url, log = start_serve([llama_dir, "--port", "0", "--cache", "sparsex", "--dtype", "float32",
                                  "--num-blocks", str(POOL), "--served-model-name", "tiny",
                                  "--tensor-parallel-size", "2", "--torch-threads", "1", "--log-level", "info"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        want = LLM(model=llama_dir, cache="prefix", dtype="float32", num_blocks=POOL)
        ref = want.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True), use_tqdm=False)[0]
        _close(want)
        done = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].text == ref.outputs[0].text
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                                max_tokens=6, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len([c for c in chunks if c]) >= 1 and "".join(chunks)
        ranks = _children(proc.pid)
        assert len(ranks) == 1                              # rank 1's process
        os.kill(ranks[0], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as err:
            client.with_options(max_retries=0).completions.create(model="tiny", prompt="Another request",
                                                                 max_tokens=4, temperature=0)
        assert err.value.status_code == 503
        assert proc.wait(timeout=60) == 1                   # the server stops: no hang, no 503 forever
        time.sleep(0.2)
        assert any("rank 1 exited with code -9" in line for line in log), log[-5:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- blending across ranks (last: its engines stay open until the module ends, and a process
# holds one tensor-parallel group at a time) -------------------------------------------------------

@pytest.fixture(scope="module")
def blend_engines(llama_dir):
    """A TP=1 and a TP=2 engine with segment reuse, shared by the blending tests (each resets the caches)."""
    kw = dict(model=llama_dir, cache="sparsex", dtype="float32", num_blocks=POOL, min_blend_tokens=0,
              transparent_segments=False, full_layers=2, recompute_ratio=0.25)
    engines = {tp: LLM(tensor_parallel_size=tp, **kw) for tp in (1, 2)}
    yield engines
    _close(*engines.values())


@pytest.mark.model
@pytest.mark.parametrize("selector", ["sparse_q", "kv_deviation", "query_fused", "chunk_anchor"])
def test_a_blended_request_keeps_the_same_rows_on_both_ranks_and_matches_tp1(blend_engines, wiki_texts, selector):
    """Each rank scores with its own heads; the scores are reduced before the top-k, so both ranks
    keep the same rows (StepBlend checks it on every CPU selection) and the request equals TP=1's.
    The passages are computed twice first (merged encodings: a write outside the forward that every
    rank replays)."""
    results = {}
    for tp, llm in blend_engines.items():
        eng = llm.llm_engine
        llm.reset_cache()
        first, second = _blend_prompts(eng, wiki_texts)
        run_to_completion(eng, first, ONE)
        # the same passages after another system prompt, computed exactly: merged encodings
        again = pieces_prompt(eng, ["System: a different opening.\n\n", *_passages(wiki_texts), "\nQ:"],
                              [True] * 4 + [False])
        run_to_completion(eng, again, ONE, reuse={"blend": False})
        assert max(e.num_encodings for e in eng.segment_index.entries.values()) == 2
        n = len(second.token_ids)
        out, dist = run_to_completion(eng, second, GREEDY, reuse={"selector": selector}, distributions_from=n - 8)
        results[tp] = (out, torch.stack([dist[i] for i in range(n - 8, n)]))
        eng.check_integrity()
    (o1, d1), (o2, d2) = results[1], results[2]
    assert o2.num_reused_tokens == o1.num_reused_tokens > 200
    assert o2.num_recomputed_tokens == o1.num_recomputed_tokens > 0
    assert o2.outputs[0].token_ids == o1.outputs[0].token_ids
    assert ((d2 - d1).norm() / d1.norm()).item() < 1e-4


@pytest.mark.model
def test_selector_all_under_tp2_equals_plain_prefill(blend_engines, wiki_texts):
    one, two = blend_engines[1].llm_engine, blend_engines[2].llm_engine
    for llm in blend_engines.values():
        llm.reset_cache()
    first, second = _blend_prompts(two, wiki_texts)
    run_to_completion(two, first, ONE)
    n = len(second.token_ids)
    out, got = run_to_completion(two, second, ONE, reuse={"selector": "all"}, distributions_from=n - 8)
    _, want = run_to_completion(one, second, ONE, reuse={"blend": False}, distributions_from=n - 8)   # plain prefill
    assert out.num_reused_tokens > 200 and out.num_recomputed_tokens == out.num_reused_tokens
    got, want = (torch.stack([d[i] for i in range(n - 8, n)]) for d in (got, want))
    assert ((got - want).norm() / want.norm()).item() < 1e-4

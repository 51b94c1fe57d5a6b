"""The engine on one GPU (H200): prefill, decode and blended prefill against baselines measured in the
same call, plus SmolLM2 parity and bf16 agreement. GPU machine only.

    PYTHONPATH=. python3 benchmarks/gpu_engine.py [--sections ceil,prefill,decode,blend,smol] [--out DIR]

Sections (each prints a table; all numbers of a table come from this one process):
  ceil     measured ceilings: 8192^3 bf16 matmul (TFLOP/s) and a 2 GiB device copy (bytes read + written).
  prefill  full prefill at 2k/8k/32k, one sequence: our model forward (Triton paged attention, logits of
           the last token only) vs transformers' LlamaForCausalLM (SDPA) on the same weights
           (`logits_to_keep=1`); MFU against the measured matmul peak; a torch.profiler split at 8k.
  decode   decode tokens/s at batch 1/16/64 with 2k context: the engine's step loop with CUDA graphs,
           the same with enforce_eager, and transformers' per-step loop (forward + DynamicCache + argmax,
           what `generate` runs each step) on random 2k caches; fraction of the HBM floor
           ((weights + KV bytes) per step / measured copy bandwidth).
  blend    TTFT of RAG-like prompts (system + k passages x 512 tokens + question) whose passages were
           cached by an earlier prompt in another order: cache="sparsex" (full_layers=2,
           recompute_ratio=0.15, default selector) vs "none" vs "prefix", with a CUDA-event breakdown;
           replayed three ways: interleaved (the engines in turn), back to back (one engine's requests
           in a row) and idle start (interleaved, the GPU idle IDLE_S before each request, so none
           inherits the power/clock state the previous one left). `--variants "k=v,k=v;..."` replays
           more knob sets of the sparsex engine (per-request reuse overrides) the same way.
  spans    what finding spans by content costs on the TTFT path at 8k and 32k tokens: passages cached
           by an earlier prompt, asked for in another order as explicit segments and as one unmarked
           run of token ids; span search ms and its share of the blended TTFT.
  blendprof  one blended request at 16 and 64 passages (8k and 32k tokens): host time per engine phase and the GPU
           timeline (busy, idle, largest gaps) from torch.profiler.
  syncs    every host<-device synchronisation of one blended request (torch's sync debug mode), with
           the engine frames that made it; a blended step should sync only for its sampled token.
  smol     SmolLM2-135M (real weights, needs the staged GGUF): fp32 greedy tokens vs the CPU path
           (tests/data/smollm2_greedy_cpu.json) and vs transformers on the GPU; bf16 teacher-forced
           top-1 agreement with fp32.
Sections ceil..blend use random weights of the Llama-3-8B shape ("dummy:llama3-8b", bf16): speed only;
token ids are random too. Times: CUDA events or host clocks after a device sync, medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsex import LLM, SamplingParams  # noqa: E402
from sparsex.bench.policies import parse_knob  # noqa: E402
from sparsex.bench.flop_model import FlopModel  # noqa: E402
from sparsex.layers.forward_context import ForwardContext  # noqa: E402
from sparsex.segment.step_blend import StepBlend  # noqa: E402
from sparsex.layers.attention_metadata import AttentionMetadata  # noqa: E402
from sparsex.models import loader  # noqa: E402

DEV = torch.device("cuda")
MODEL = "dummy:llama3-8b"
MAX_LEN = 40960
# (tokens, warm-up, repeats) per prefill; decode batches and context; blend passages per prompt x tokens each
SIZES = {"prefill": ((2048, 2, 5), (8192, 1, 3), (32768, 1, 3)), "profile": 8192, "decode_batches": (1, 16, 64),
         "decode_ctx": 2048, "passages": (8, 16, 32, 64), "passage_len": 512, "span_passages": (16, 64)}
GIB = 1 << 30
RESULTS: dict = {}
_rng = np.random.default_rng(0)


def log(*a) -> None:
    print(*a, flush=True)


def table(title: str, header: list[str], rows: list[list]) -> None:
    log(f"\n### {title}\n")
    log("| " + " | ".join(header) + " |")
    log("|" + "---|" * len(header))
    for r in rows:
        log("| " + " | ".join(str(x) for x in r) + " |")


def cuda_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rand_ids(n: int) -> list[int]:
    return _rng.integers(3, 48000, n).tolist()


# ------------------------------------------------------------------------------ setup helpers
class _NullTokenizer:
    """Random weights make text meaningless; stands in when SmolLM2's tokenizer is not staged."""
    eos_token_id = 2
    chat_template = None

    def decode(self, ids, **kw) -> str:
        return ""

    def encode(self, text, **kw):
        raise ValueError("this benchmark sends token ids only")


def _patch_dummy_tokenizer() -> None:
    real = loader._dummy_tokenizer

    def tokenizer(root):
        tok = real(root)
        return tok if tok is not None else _NullTokenizer()
    loader._dummy_tokenizer = tokenizer


def _blend_pool_gib(llm: LLM) -> tuple[float, float]:
    """KV pools of the blend section's prefix and sparsex engines: at least 6 and 10 GiB on CUDA, more
    where one longest blend prompt (the most passages, plus head and question; at most MAX_LEN tokens)
    of this model's KV would not fit with room to spare."""
    if DEV.type != "cuda":
        return 0.2, 0.2
    runner = llm.llm_engine.runner
    longest = min(MAX_LEN, BLEND_HEAD + SIZES["passage_len"] * max(SIZES["passages"]) + BLEND_QUESTION + 64)
    request_gib = longest * runner.bytes_per_block() / runner.block_size / GIB
    return max(6.0, 1.25 * request_gib), max(10.0, 2.25 * request_gib)


BLEND_HEAD, BLEND_QUESTION = 40, 48   # blend section: tokens of a prompt's head and of its question
GC_FREEZE = False           # --gc-freeze: objects alive once an engine is built leave the cyclic GC's reach


class _SharedWeights:
    """Stands in for the meta-device model a `ModelRunner` builds: "materialising" it returns the model
    another engine already holds (same shape, dtype, device), so a second engine never allocates a
    second copy of the weights, not even for a moment (Gemma-3-12B's 22 GiB twice pass an 80 GB card)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def to_empty(self, device) -> torch.nn.Module:
        return self.model


def make_llm(cache: str, kv_gib: float, share_from: LLM | None = None) -> LLM:
    from sparsex.engine import model_runner
    kw = dict(device=DEV.type, dtype="bfloat16" if DEV.type == "cuda" else "float32", cache=cache,
              kv_cache_memory=int(kv_gib * GIB), max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN,
              max_num_seqs=64,
              # no start-up warm-up: every section runs its own untimed requests first
              # (benchmarks/gpu_startup.py measures the warm-up)
              warmup=False)
    if share_from is None:
        llm = LLM(MODEL, **kw)
    elif DEV.type != "cuda":
        # --dry-run: a CPU model is prepacked when built (done once per model), so swap after building
        llm = LLM(MODEL, **kw)
        llm.llm_engine.runner.model = share_from.llm_engine.runner.model
    else:
        # one copy of the (same-seed, random) weights on the GPU: the new engine's runner takes the
        # other engine's model instead of drawing its own
        shared = share_from.llm_engine.runner.model
        build, init = model_runner.DecoderForCausalLM, model_runner._init_random
        model_runner.DecoderForCausalLM = lambda cfg, max_len: _SharedWeights(shared)
        model_runner._init_random = lambda model, seed: None
        try:
            llm = LLM(MODEL, **kw)
        finally:
            model_runner.DecoderForCausalLM, model_runner._init_random = build, init
        if llm.llm_engine.runner.model is not shared:
            raise RuntimeError("the engine did not take the shared model")
    if GC_FREEZE:
        gc.collect()
        gc.freeze()
    return llm


def hf_from_ours(model, cfg) -> torch.nn.Module:
    """transformers' model of the same family whose parameters are views of ours (no second copy;
    `DecoderForCausalLM.hf_state_dict`)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from sparsex.models import dummy

    spec = dict(dummy.DUMMY_SHAPES[dummy.dummy_shape_of(MODEL)])
    hcfg = AutoConfig.for_model(spec.pop("model_type"), **spec, pad_token_id=0)
    hcfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hcfg)
    hf.load_state_dict(model.hf_state_dict(), strict=True, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hcfg).to(DEV)
    if hasattr(hf.model, "embed_tokens") and hasattr(hf.model.embed_tokens, "embed_scale"):
        hf.model.embed_tokens.embed_scale = torch.tensor(cfg.embedding_multiplier, device=DEV)   # Gemma's buffer
    assert not any(t.is_meta for t in list(hf.parameters()) + list(hf.buffers())), "meta tensors left in the HF model"
    return hf.eval()


def plain_prefill_md(n: int, block_size: int) -> AttentionMetadata:
    """One sequence, positions 0..n-1, in pool blocks 0..cdiv(n, block_size)-1."""
    pos = torch.arange(n, device=DEV)
    nb = -(-n // block_size)
    return AttentionMetadata(
        positions=pos, slot_mapping=pos.clone(), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=DEV),
        block_tables=torch.arange(nb, dtype=torch.int32, device=DEV)[None], max_seqlen_q=n, max_seq_len=n,
        cu_seqlens_q_cpu=[0, n], seq_lens_cpu=[n])


class SdpaPlainPrefill:
    """Diagnostic only: a one-sequence plain prefill's keys are pool slots 0..n-1 in order, so SDPA
    (flash) can run on them directly. Tells how much of the forward is the attention kernel."""
    name = "sdpa-diagnostic"

    @staticmethod
    def store_kv(key, value, k_cache, v_cache, slot_mapping):
        if key.device.type == "cuda":
            from sparsex.layers.triton_attention import TritonAttentionBackend as backend
        else:
            from sparsex.layers.attention_backend import TorchAttentionBackend as backend
        backend.store_kv(key, value, k_cache, v_cache, slot_mapping)

    @staticmethod
    def attention(query, k_cache, v_cache, md, scale, key=None, value=None, sliding_window=None,
                  logits_soft_cap=None):
        if logits_soft_cap is not None:
            raise ValueError("the SDPA diagnostic has no logits softcap")
        n = query.shape[0]
        k = k_cache.view(-1, *k_cache.shape[2:])[:n]
        v = v_cache.view(-1, *v_cache.shape[2:])[:n]
        mask = None
        if sliding_window is not None:          # key j visible to row i when i - window < j <= i (a mask: SDPA's memory-efficient path)
            i = torch.arange(n, device=query.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        o = F.scaled_dot_product_attention(query.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)


def matmul_params(cfg) -> int:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return per_layer * cfg.num_hidden_layers


def prefill_flops(cfg, n: int) -> float:
    """Matmuls of every row + causal attention (visible pairs only: a sliding layer's query sees at
    most its window) + the last row's lm_head."""
    pairs = 0
    for layer in range(cfg.num_hidden_layers):
        w = cfg.layer_window(layer)
        pairs += n * (n + 1) // 2 if w is None or w >= n else w * (w + 1) // 2 + (n - w) * w
    attn = 4 * cfg.head_dim * cfg.num_attention_heads * pairs
    return 2.0 * n * matmul_params(cfg) + attn + 2.0 * cfg.hidden_size * cfg.vocab_size


def kernel_split(prof) -> dict[str, float]:
    """Self device time (ms) of the profiled kernels, by family (names of cuBLAS/Triton/flash kernels)."""
    groups = {"gemm": 0.0, "attention": 0.0, "kv store": 0.0, "norm/rope/act/other": 0.0}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        t = getattr(e, "self_cuda_time_total", 0.0) if t is None else t
        if t <= 0 or e.key.startswith("aten::"):
            continue
        k = e.key.lower()
        if any(s in k for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")):
            family = "gemm"
        elif any(s in k for s in ("gemv",)):
            family = "gemm"
        elif any(s in k for s in ("prefill_kernel", "flash", "fmha", "attention", "decode_kernel", "decode_merge")):
            family = "attention"
        elif "store_kv" in k:
            family = "kv store"
        else:
            family = "norm/rope/act/other"
        groups[family] += t / 1e3
    return groups


# ------------------------------------------------------------------------------ sections
def section_ceil() -> dict:
    m = 8192 if DEV.type == "cuda" else 256
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    ms = cuda_ms(lambda: a @ b, 3, 10)
    tflops = 2 * m ** 3 / ms / 1e9
    x = torch.randn(GIB if DEV.type == "cuda" else 1 << 20, dtype=torch.bfloat16, device=DEV)   # 2 GiB
    y = torch.empty_like(x)
    ms_c = cuda_ms(lambda: y.copy_(x), 2, 10)
    bw = 2 * x.numel() * 2 / ms_c / 1e9                           # TB/s
    del a, b, x, y
    table("Measured ceilings", ["what", "value"], [["bf16 matmul 8192^3", f"{tflops:.0f} TFLOP/s"],
                                                  ["device copy 2 GiB", f"{bw:.2f} TB/s"]])
    RESULTS["ceil"] = {"tflops": tflops, "tbps": bw}
    return RESULTS["ceil"]


def section_prefill(llm: LLM, hf, ceil: dict) -> None:
    runner = llm.llm_engine.runner
    model, cfg = runner.model, runner.model_config
    rows, out = [], []
    for n, warm, reps in SIZES["prefill"]:
        ids = torch.tensor(rand_ids(n), device=DEV)
        md = plain_prefill_md(n, runner.block_size)
        ctx = ForwardContext(attn_metadata=md, kv_caches=runner.kv_caches, backend=runner.backend)
        ctx_sdpa = ForwardContext(attn_metadata=md, kv_caches=runner.kv_caches, backend=SdpaPlainPrefill)
        with torch.inference_mode():
            ours = lambda: model.compute_logits(model(ids, md.positions, ctx)[-1:])
            ours_sdpa = lambda: model.compute_logits(model(ids, md.positions, ctx_sdpa)[-1:])
            theirs = lambda: hf(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits[0]
            rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
            err, err_diag = rel(ours(), theirs()), rel(ours(), ours_sdpa())
            t_ours = cuda_ms(ours, warm, reps)
            t_hf = cuda_ms(theirs, warm, reps)
            t_sdpa = cuda_ms(ours_sdpa, warm, reps)
        fl = prefill_flops(cfg, n)
        mfu = lambda ms: fl / (ms * 1e-3) / (ceil["tflops"] * 1e12)
        rows.append([f"{n:,}", f"{t_ours:.1f} ms", f"{t_hf:.1f} ms", f"{t_ours / t_hf:.3f}", f"{mfu(t_ours):.2f}",
                     f"{mfu(t_hf):.2f}", f"{t_sdpa:.1f} ms", f"{err:.1e}"])
        out.append({"tokens": n, "ours_ms": t_ours, "hf_ms": t_hf, "ours_sdpa_diag_ms": t_sdpa, "tflop": fl / 1e12,
                    "mfu_ours": mfu(t_ours), "mfu_hf": mfu(t_hf), "rel_err_last_logits": err,
                    "rel_err_vs_sdpa_diag": err_diag})
        log(f"prefill {n}: ours {t_ours:.1f} ms, hf {t_hf:.1f} ms, ours+sdpa {t_sdpa:.1f} ms, err {err:.1e} "
            f"(ours vs ours-with-SDPA-attention {err_diag:.1e})")
    table(f"Full prefill, one sequence (random weights, {MODEL} shape, bf16)",
          ["tokens", "SparseX forward (Triton)", "transformers SDPA", "ours / HF", "MFU ours", "MFU HF",
           "diag: ours with SDPA attention", "rel. err. last logits"], rows)
    # where the time goes at 8k
    from torch.profiler import ProfilerActivity, profile
    n = SIZES["profile"]
    ids = torch.tensor(rand_ids(n), device=DEV)
    md = plain_prefill_md(n, runner.block_size)
    ctx = ForwardContext(attn_metadata=md, kv_caches=runner.kv_caches, backend=runner.backend)
    splits = {}
    with torch.inference_mode():
        for name, fn in (("ours", lambda: model.compute_logits(model(ids, md.positions, ctx)[-1:])),
                         ("hf", lambda: hf(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits)):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA if DEV.type == "cuda" else ProfilerActivity.CPU]) as prof:
                fn()
                torch.cuda.synchronize()
            splits[name] = kernel_split(prof)
            if OUT:
                try:
                    text = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
                except Exception as exc:                      # older profilers name the column differently
                    text = f"table failed: {exc!r}"
                with open(os.path.join(OUT, f"profile_prefill8k_{name}.txt"), "w") as f:
                    f.write(text)
    table("Kernel time by family, 8k prefill (torch.profiler, ms of device time)",
          ["family", "SparseX", "transformers"],
          [[k, f"{splits['ours'][k]:.1f}", f"{splits['hf'][k]:.1f}"] for k in splits["ours"]])
    RESULTS["prefill"] = {"rows": out, "profile_8k_ms": splits}


def _engine_decode(llm: LLM, batch: int, ctx_len: int, warm: int, steps: int) -> dict:
    eng = llm.llm_engine
    runner = eng.runner
    params = SamplingParams(temperature=0.0, max_tokens=2 * (warm + steps) + 4, ignore_eos=True)
    rids = [f"dec{batch}-{i}" for i in range(batch)]
    for rid in rids:
        eng.add_request(rid, {"prompt_token_ids": rand_ids(ctx_len)}, params)
    reqs = [eng.requests[r] for r in rids]
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    res = {}
    for mode in ("graph", "eager"):
        eng.config.enforce_eager = mode == "eager"
        for _ in range(warm):
            eng.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        res[mode] = batch * steps / (time.perf_counter() - t0)
    eng.config.enforce_eager = False
    eng.abort_request(rids)
    eng.check_integrity()
    return res


def _hf_decode(hf, cfg, batch: int, ctx_len: int, warm: int, steps: int) -> float:
    from transformers import DynamicCache
    cache = DynamicCache()
    shape = (batch, cfg.num_key_value_heads, ctx_len, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=torch.bfloat16, device=DEV),
                     torch.randn(shape, dtype=torch.bfloat16, device=DEV), layer)
    tok = torch.randint(3, 48000, (batch, 1), device=DEV)
    pos = ctx_len
    t0 = None
    with torch.inference_mode():
        for i in range(warm + steps):
            if i == warm:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            out = hf(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1,
                     position_ids=torch.full((batch, 1), pos, device=DEV),
                     cache_position=torch.tensor([pos], device=DEV))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            pos += 1
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del cache, out
    torch.cuda.empty_cache()
    return batch * steps / dt


def _hf_generate_b1(hf, ctx_len: int, new: int) -> float:
    """transformers' own generate at batch 1: decode tok/s = (new-1) / (t(new) - t(1))."""
    ids = torch.tensor([rand_ids(ctx_len)], device=DEV)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)
    times = {}
    with torch.inference_mode():
        for n in (1, new):
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t0
    return (new - 1) / (times[new] - times[1])


def _decode_bytes(runner) -> tuple[int, int]:
    """What a decode step must read: every weight except the embedding table (a lookup reads only a
    few rows of it), and the KV bytes per context token."""
    weight_bytes = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
                       if not n.startswith("embed_tokens"))
    return weight_bytes, runner.bytes_per_block() // runner.block_size


def section_decode(llm: LLM, hf, ceil: dict) -> None:
    runner = llm.llm_engine.runner
    cfg = runner.model_config
    ctx_len = SIZES["decode_ctx"]
    weight_bytes, kv_per_token = _decode_bytes(runner)
    rows, out = [], []
    for batch in SIZES["decode_batches"]:
        ours = _engine_decode(llm, batch, ctx_len, warm=4, steps=24)
        theirs = _hf_decode(hf, cfg, batch, ctx_len, warm=3, steps=12)
        step_bytes = weight_bytes + batch * (ctx_len + 40) * kv_per_token
        floor_tok_s = batch / (step_bytes / (ceil["tbps"] * 1e12))
        rows.append([batch, f"{ours['graph']:.0f}", f"{ours['eager']:.0f}", f"{theirs:.0f}",
                     f"{ours['graph'] / theirs:.1f}x", f"{floor_tok_s:.0f}", f"{ours['graph'] / floor_tok_s:.2f}"])
        out.append({"batch": batch, "graph_tok_s": ours["graph"], "eager_tok_s": ours["eager"], "hf_loop_tok_s": theirs,
                    "floor_tok_s": floor_tok_s, "step_gb": step_bytes / 1e9})
        log(f"decode b{batch}: {out[-1]}")
    gen_b1 = _hf_generate_b1(hf, ctx_len, 17)
    table(f"Decode, 2k context (random weights, {MODEL} shape, bf16; tokens/s over all sequences)",
          ["batch", "SparseX + CUDA graphs", "SparseX eager", "transformers step loop", "graphs / HF",
           "HBM floor", "fraction of floor"], rows)
    log(f"\ntransformers `generate` at batch 1 (2k prompt, its prefill subtracted): {gen_b1:.1f} tok/s")
    RESULTS["decode"] = {"rows": out, "hf_generate_b1_tok_s": gen_b1, "weight_gb": weight_bytes / 1e9}


def section_decode_profile(llm: LLM, ceil: dict) -> None:
    """Where a graphed decode step's time goes: engine host work, runner host work, GPU (replay)."""
    from torch.profiler import ProfilerActivity, profile
    eng = llm.llm_engine
    runner = eng.runner
    ctx_len = SIZES["decode_ctx"]
    weight_bytes, kv_per_token = _decode_bytes(runner)
    rows, out = [], []
    for batch in (1, 64) if DEV.type == "cuda" else (1, 3):
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        rids = [f"prof{batch}-{i}" for i in range(batch)]
        for rid in rids:
            eng.add_request(rid, {"prompt_token_ids": rand_ids(ctx_len)}, params)
        reqs = [eng.requests[r] for r in rids]
        while any(not r.output_token_ids for r in reqs):
            eng.step()
        for _ in range(4):
            eng.step()
        exec_s, launched_at = [], []
        launch, collect = runner.launch, runner.collect

        def timed_launch(sched):
            launched_at.append(time.perf_counter())
            return launch(sched)

        def timed_collect(step):
            r = collect(step)
            exec_s.append(time.perf_counter() - launched_at.pop())    # launch entry to collect exit
            return r
        runner.launch, runner.collect = timed_launch, timed_collect
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = 16
        for _ in range(steps):
            eng.step()
        step_ms = 1e3 * (time.perf_counter() - t0) / steps
        del runner.launch, runner.collect
        exec_ms = 1e3 * statistics.median(exec_s)
        graphs = runner.decode_graphs
        if graphs is not None:
            g = graphs.graphs[next(b for b in graphs.sizes if b >= batch)]
            replay_ms = cuda_ms(g.replay, 3, 20)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    g.replay()
                torch.cuda.synchronize()
            split = {k: v / 5 for k, v in kernel_split(prof).items()}
            if OUT:
                try:
                    text = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
                except Exception as exc:
                    text = f"table failed: {exc!r}"
                with open(os.path.join(OUT, f"profile_decode_b{batch}.txt"), "w") as f:
                    f.write(text)
        else:
            replay_ms, split = float("nan"), {}
        eng.abort_request(rids)
        floor_ms = 1e3 * (weight_bytes + batch * (ctx_len + 30) * kv_per_token) / (ceil["tbps"] * 1e12)
        rows.append([batch, f"{step_ms:.2f}", f"{exec_ms:.2f}", f"{step_ms - exec_ms:.2f}", f"{replay_ms:.2f}",
                     f"{floor_ms:.2f}", " / ".join(f"{v:.2f}" for v in split.values())])
        out.append({"batch": batch, "step_ms": step_ms, "execute_ms": exec_ms, "replay_gpu_ms": replay_ms,
                    "floor_ms": floor_ms, "split_ms": split})
        log(f"decode profile b{batch}: {out[-1]}")
    table(f"Graphed decode step, 2k context: where the time goes (random weights, {MODEL} shape, bf16)",
          ["batch", "engine step ms (wall)", "runner launch..collect ms", "engine outside runner ms", "graph replay GPU ms",
           "HBM floor ms", "replay kernels: gemm / attention / kv store / other ms"], rows)
    RESULTS["decode_profile"] = out


class BlendTimer:
    """CUDA events around the blended step's stages (the KV copy + re-rotation, launched from inside
    the forward just before layer F-1; the probe = selection scoring inside layer F-1; the row
    selection, inside layer F-1 once it has stored every row's K/V; then the sparse part: layer
    F-1's attention and MLP on the kept rows, and layers F..L-1)."""

    def __init__(self, runner):
        self.active = False
        self.events: dict[str, list[torch.cuda.Event]] = {}     # two-stage selection probes and selects twice
        # every step builds its own StepBlend: wrap the class's methods (restored by `close`)
        self._originals = {name: getattr(StepBlend, name) for name in ("_copy_reused", "_probe", "select")}
        copy, probe, select = (self._originals[n] for n in ("_copy_reused", "_probe", "select"))

        def timed_copy(*a, **k):
            self._rec("prep0"); copy(*a, **k); self._rec("prep1")

        def timed_probe(*a, **k):
            self._rec("probe0"); probe(*a, **k); self._rec("probe1")

        def timed_select(*a, **k):
            self._rec("sel0"); out = select(*a, **k); self._rec("sel1"); return out
        StepBlend._copy_reused, StepBlend._probe, StepBlend.select = timed_copy, timed_probe, timed_select
        layers = runner.model.layers
        self.handles = [
            layers[0].register_forward_pre_hook(lambda m, a: self._rec("layer0")),
            layers[-1].register_forward_hook(lambda m, a, o: self._rec("sparse_end")),
        ]

    def start(self) -> None:
        self.events = {}
        self.active = True

    def _rec(self, name: str) -> None:
        if self.active:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.setdefault(name, []).append(e)

    def split_ms(self) -> dict[str, float]:
        """The first selection splits the full layers from the sparse part; a second probe and
        selection (two-stage selection) are counted as scoring / selection, not as sparse layers."""
        e = self.events
        if "prep0" not in e:                         # the request found nothing to reuse
            return {k: float("nan") for k in ("kv copy+rerotate", "full layers", "selection scoring (probe)",
                                              "row selection", "sparse layers")}
        el = lambda a, b, i=0: e[a][i].elapsed_time(e[b][i])
        probes = [el("probe0", "probe1", i) for i in range(len(e.get("probe0", [])))]
        selects = [el("sel0", "sel1", i) for i in range(len(e["sel0"]))]
        copy = el("prep0", "prep1")
        order = list(e)
        copy_inside = order.index("prep0") > order.index("layer0")          # launched after layer 0 began
        first_probe = probes[0] if probes else 0.0
        return {"kv copy+rerotate": copy,
                "full layers": el("layer0", "sel0") - first_probe - (copy if copy_inside else 0.0),
                "selection scoring (probe)": sum(probes), "row selection": sum(selects),
                "sparse layers": el("sel1", "sparse_end") - sum(probes[1:]) - sum(selects[1:])}

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for name, f in self._originals.items():
            setattr(StepBlend, name, f)


def _alloc_counts(since: dict[str, int] | None = None) -> dict[str, int]:
    """The caching allocator's calls to cudaMalloc / cudaFree (and retries after a failed malloc,
    which free the whole cache) so far, or since the counts `since`: a blended step that has to
    grow the pool pays for them."""
    if not torch.cuda.is_available():
        now = {"malloc": 0, "free": 0, "retries": 0}
    else:
        st = torch.cuda.memory_stats()
        now = {"malloc": st.get("num_device_alloc", 0), "free": st.get("num_device_free", 0),
               "retries": st.get("num_alloc_retries", 0)}
    return now if since is None else {key: v - since[key] for key, v in now.items()}


IDLE_S = 0.5                # idle-start replay: the GPU sits idle this long before each timed request
WALL: list[tuple[str, float, float]] = []             # (tag, start, end) wall clock of every request


def _ttft(llm: LLM, prompt: dict, tag: str, idle_s: float = 0.0, reuse: dict | None = None) -> tuple[float, object]:
    eng = llm.llm_engine
    tp = eng.tokenize(prompt)                           # host tokenisation stays outside the clock
    torch.cuda.synchronize()
    if idle_s:
        time.sleep(idle_s)
    w0 = time.time()
    t0 = time.perf_counter()
    eng.add_request(tag, tp, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), reuse=reuse)
    done = None
    while done is None:
        for o in eng.step():
            if o.finished:
                done = o
    WALL.append((tag, w0, time.time()))
    return time.perf_counter() - t0, done


def _timed(timer: BlendTimer, llm: LLM, prompt: dict, tag: str, splits: list | None,
           idle_s: float = 0.0, reuse: dict | None = None) -> tuple[float, object]:
    """`_ttft`, with the blended step's GPU stages appended to `splits` (None: not timed)."""
    if splits is not None:
        timer.start()
    out = _ttft(llm, prompt, tag, idle_s, reuse)
    timer.active = False
    if splits is not None:
        splits.append(timer.split_ms())
    return out


def section_blend(llm_none: LLM, llm_prefix: LLM, llm_sx: LLM,
                  variants: list[tuple[str, dict | None]] = (("default", None),)) -> None:
    """`variants`: (label, per-request reuse overrides) of the sparsex engine, each replayed the three
    ways against none and prefix runs of its own (so every ratio is within one variant's replay)."""
    runner = llm_sx.llm_engine.runner
    cfg = runner.model_config
    timer = BlendTimer(runner)
    sys_ids, rows, out = rand_ids(BLEND_HEAD), [], []
    warm = {"sys": 0}
    # --no-prefix-engine: a card too small for three engines' pools runs none and sparsex only
    engines = [("none", llm_none)] + ([("prefix", llm_prefix)] if llm_prefix is not None else []) + [("sparsex", llm_sx)]
    plen = SIZES["passage_len"]
    for k in SIZES["passages"]:
        passages = [rand_ids(plen) for _ in range(k)]
        # every timed request: a new order of the passages, after a head of its own (with a shared head,
        # a request whose first passages an earlier one had in the same order would continue that
        # request's blended blocks on the approximate prefix chain and blend less)
        order = lambda r: np.random.default_rng(1000 * k + r).permutation(k)
        head = lambda r: np.random.default_rng(7 + r).integers(3, 48000, len(sys_ids)).tolist()
        prompt = lambda r, q: {"segments": [head(r)] + [passages[i] for i in order(r)] + [q]}
        # caches the passages; a filler first, so that no passage is computed right after the short
        # head (the engine would not reuse such an early encoding later in a prompt: min_context_tokens)
        prime = {"segments": [sys_ids, rand_ids(plen)] + passages + [rand_ids(48)]}
        for _, llm in engines[1:]:            # the caching engines
            llm.reset_cache()
            _ttft(llm, prime, f"prime{k}-{id(llm)}")
        if not warm["sys"]:
            _ttft(llm_none, prompt(99, rand_ids(48)), "warm-none")
            warm["sys"] = 1
        for vi, (label, rv) in enumerate(variants):
            reuse = dataclasses.replace(llm_sx.config.reuse, **(rv or {})).resolved(cfg.num_hidden_layers)
            v0 = 100 * vi           # this variant's orders
            # one untimed blended request first: the first blend of a process compiles the blend's
            # kernels (seconds), which would otherwise be one of the interleaved replay's three samples
            _ttft(llm_sx, prompt(v0 + 11, rand_ids(48)), f"s{k}-warm-{label}", reuse=rv)
            t = {name: [] for name, _ in engines}
            splits, host = [], []
            for r in (1, 2, 3):
                q = rand_ids(BLEND_QUESTION)
                t["none"].append(_ttft(llm_none, prompt(v0 + r, q), f"n{k}-{r}-{label}")[0])
                if llm_prefix is not None:
                    t["prefix"].append(_ttft(llm_prefix, prompt(v0 + r, q), f"p{k}-{r}-{label}")[0])
                c0, s0 = runner.timings.blend_copy_s, runner.timings.selection_s
                m0 = _alloc_counts()
                ts, o = _timed(timer, llm_sx, prompt(v0 + r, q), f"s{k}-{r}-{label}", splits, reuse=rv)
                t["sparsex"].append(ts)
                host.append({"copy_host_ms": 1e3 * (runner.timings.blend_copy_s - c0),
                             "selection_host_ms": 1e3 * (runner.timings.selection_s - s0),
                             "reused": o.num_reused_tokens, "recomputed": o.num_recomputed_tokens,
                             "candidates": o.num_candidate_tokens, "cached": o.num_cached_tokens,
                             "device_mallocs": _alloc_counts(m0)})
            # the same requests again, each engine's three back to back (after one untimed request):
            # what a GPU serving one engine sees, without another engine's run in between
            grouped = {"sparsex_gpu_split_ms": []}
            for name, llm in engines:
                kw = {"reuse": rv} if name == "sparsex" else {}
                _ttft(llm, prompt(v0 + 4, rand_ids(48)), f"g{name}{k}-warm-{label}", **kw)
                m0 = _alloc_counts()
                gs = grouped["sparsex_gpu_split_ms"] if name == "sparsex" else None
                runs = [_timed(timer, llm, prompt(v0 + r, rand_ids(48)), f"g{name}{k}-{r}-{label}", gs, **kw)
                        for r in (5, 6, 7)]
                grouped[name] = 1e3 * statistics.median(t_ for t_, _ in runs)
                grouped[name + "_device_mallocs"] = _alloc_counts(m0)
                grouped[name + "_reused_recomputed"] = [(o.num_reused_tokens, o.num_recomputed_tokens) for _, o in runs]
            # and once more, interleaved, but every timed request starts from an idle GPU (IDLE_S asleep
            # first): what a request costs without the power and clock state the previous one left
            idle_t, idle_splits = {name: [] for name, _ in engines}, []
            for r in (8, 9, 10):
                q = rand_ids(BLEND_QUESTION)
                for name, llm in engines:
                    gs = idle_splits if name == "sparsex" else None
                    kw = {"reuse": rv} if name == "sparsex" else {}
                    idle_t[name].append(1e3 * _timed(timer, llm, prompt(v0 + r, q), f"i{name}{k}-{r}-{label}", gs,
                                                     IDLE_S, **kw)[0])
            idle = {key: statistics.median(v) for key, v in idle_t.items()} | {"sparsex_gpu_split_ms": idle_splits}
            med = {p: 1e3 * statistics.median(v) for p, v in t.items()}
            n_tok = len(sys_ids) + plen * k + BLEND_QUESTION
            split = {key: statistics.median([s[key] for s in splits if s[key] == s[key]] or [float("nan")])
                     for key in splits[0]}
            h = host[-1]
            rows_ = n_tok - h["cached"]
            floor = FlopModel.from_config(cfg).token_layers(
                rows_, rows_ - h["reused"] + h["recomputed"], reuse.full_layers,
                rows_ - h["reused"] + h["candidates"], reuse.rescore_layers) / (cfg.num_hidden_layers * n_tok)
            prefix_ms = f"{med['prefix']:.1f}" if "prefix" in med else "–"
            rows.append([f"{k} x {plen} = {n_tok:,}", label, f"{med['none']:.1f}", prefix_ms, f"{med['sparsex']:.1f}",
                         f"{med['sparsex'] / med['none']:.3f}",
                         f"{grouped['none']:.1f} / {grouped['sparsex']:.1f} / {grouped['sparsex'] / grouped['none']:.3f}",
                         f"{idle['none']:.1f} / {idle['sparsex']:.1f} / {idle['sparsex'] / idle['none']:.3f}",
                         f"{floor:.3f}",
                         " / ".join(f"{split[key]:.1f}" for key in split),
                         f"{h['reused']:,} / {h['candidates']:,} / {h['recomputed']:,}"])
            out.append({"passages": k, "tokens": n_tok, "variant": label, "reuse": dataclasses.asdict(reuse),
                        "ttft_ms": med, "gpu_split_ms": split, "host": host,
                        "token_layer_share": floor, "grouped_ttft_ms": grouped, "idle_start_ttft_ms": idle})
            log(f"blend {k} {label}: {out[-1]}")
    timer.close()
    table("Blended prefill TTFT, passages cached in another order (random weights + random token ids, "
          f"{MODEL} shape, bf16; cache=sparsex, knobs per row: default = the engine's ReuseConfig())",
          ["prompt tokens", "knobs", "none ms", "prefix ms", "sparsex ms", "sparsex / none",
           "back to back: none / sparsex ms / ratio", f"idle start ({IDLE_S} s): none / sparsex ms / ratio",
           "token-layer share",
           "sparsex GPU split ms: copy / full layers / scoring / selection / sparse layers",
           "reused / candidates / recomputed"],
          rows)
    RESULTS["blend"] = out
    RESULTS["request_wall_clock"] = WALL


def section_spans(llm_none: LLM, llm_sx: LLM) -> None:
    """What finding spans by content costs on the TTFT path: the same passages cached by an earlier
    prompt, asked for in another order, sent as explicit segments (found whole; the span search
    still scans the rest of the prompt) and as one unmarked run of token ids (every passage found by
    content, in the exact KV an earlier request left). Interleaved, three requests per row, medians."""
    span_index = llm_sx.llm_engine.span_index
    plen, rows, out = SIZES["passage_len"], [], []
    for k in SIZES["span_passages"]:
        passages = [rand_ids(plen) for _ in range(k)]
        order = lambda r: np.random.default_rng(5000 * k + r).permutation(k)
        head = lambda r: np.random.default_rng(70 + r).integers(3, 48000, 40).tolist()
        for form in ("explicit segments", "one message"):
            def prompt(r, q, form=form):
                pieces = [head(r)] + [passages[i] for i in order(r)] + [q]
                if form == "explicit segments":
                    return {"segments": pieces}
                return {"prompt_token_ids": [t for p_ in pieces for t in p_]}
            # a filler first, so that no passage is computed right after the short head (min_context_tokens)
            prime = [head(0), rand_ids(plen)] + passages + [rand_ids(48)]
            llm_sx.reset_cache()
            _ttft(llm_sx, {"segments": prime} if form == "explicit segments"
                  else {"prompt_token_ids": [t for p_ in prime for t in p_]}, f"sp-prime{k}-{form}")
            _ttft(llm_sx, prompt(11, rand_ids(48)), f"sp-warm{k}-{form}")          # compiles, untimed
            _ttft(llm_none, prompt(11, rand_ids(48)), f"sp-warmn{k}-{form}")
            t_none, t_sx, search, found = [], [], [], []
            for r in (1, 2, 3):
                q = rand_ids(48)
                t_none.append(1e3 * _ttft(llm_none, prompt(r, q), f"spn{k}-{r}-{form}")[0])
                s0 = span_index.search_seconds
                ts, o = _ttft(llm_sx, prompt(r, q), f"sps{k}-{r}-{form}")
                t_sx.append(1e3 * ts)
                search.append(1e3 * (span_index.search_seconds - s0))
                found.append((o.num_reused_tokens, sorted({s.source for s in o.reused_spans})))
            med = {"none": statistics.median(t_none), "sparsex": statistics.median(t_sx),
                   "search": statistics.median(search)}
            n_tok = 40 + plen * k + 48
            rows.append([f"{k} x {plen} = {n_tok:,}", form, f"{med['none']:.1f}", f"{med['sparsex']:.1f}",
                         f"{med['sparsex'] / med['none']:.3f}", f"{med['search']:.2f}",
                         f"{100 * med['search'] / med['sparsex']:.2f}%",
                         f"{found[-1][0]:,} ({', '.join(found[-1][1])})", f"{span_index.num_anchors():,}"])
            out.append({"passages": k, "tokens": n_tok, "form": form, "ttft_ms": med, "search_ms": search,
                        "reused_sources": found, "anchors": span_index.num_anchors()})
            log(f"spans {k} {form}: {out[-1]}")
    table(f"Span search on the TTFT path (random weights + random token ids, {MODEL} shape, bf16; "
          "cache=sparsex defaults, transparent_segments on)",
          ["prompt tokens", "prompt form", "none ms", "sparsex ms", "sparsex / none", "span search ms",
           "share of sparsex TTFT", "reused tokens (sources)", "anchors indexed"], rows)
    RESULTS["spans"] = out


def _top_kernels(prof, n: int = 12) -> list[tuple[str, float, int]]:
    """The `n` kernels with the most self device time: (name, ms, calls)."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        t = getattr(e, "self_cuda_time_total", 0.0) if t is None else t
        if t > 0 and not e.key.startswith("aten::"):
            rows.append((e.key[:60], round(t / 1e3, 3), e.count))
    return sorted(rows, key=lambda r: -r[1])[:n]


def _gpu_timeline(prof) -> dict:
    """Kernel intervals of a torch.profiler run -> busy time, idle gaps inside the span, largest gaps."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    if not ks:
        return {"kernels": 0}
    busy, gaps, end, prev = 0.0, [], ks[0][0], ks[0][2]
    for a, b, name in ks:
        if a > end:
            gaps.append((a - end, prev, name))
        busy += max(0.0, b - max(a, end))
        if b > end:
            end, prev = b, name
    gaps.sort(reverse=True)
    cpu = [(e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CPU]
    # host time before the first kernel starts / after the last one ends, within the profiled request
    lead = (ks[0][0] - min(a for a, _ in cpu)) / 1e3 if cpu else 0.0
    tail = (max(b for _, b in cpu) - end) / 1e3 if cpu else 0.0
    return {"kernels": len(ks), "span_ms": (end - ks[0][0]) / 1e3, "busy_ms": busy / 1e3,
            "lead_ms": lead, "tail_ms": tail,
            "idle_ms": sum(g for g, _, _ in gaps) / 1e3,
            "largest_gaps": [(round(g / 1e3, 3), a[:40], b[:40]) for g, a, b in gaps[:6]]}


def section_blend_profile(llm_sx: LLM) -> None:
    """Where a blended request's TTFT goes on the host and whether the GPU waits for it: host time per
    engine phase (wrapped methods), and the GPU timeline of the same request (torch.profiler, a
    separate repetition so the profiler's overhead stays out of the host numbers)."""
    import collections
    eng = llm_sx.llm_engine
    runner = eng.runner
    phases: dict[str, float] = collections.defaultdict(float)
    wrapped = []

    def wrap(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            marks.setdefault(label + ":enter", t)
            try:
                return f(*a, **k)
            finally:
                marks[label + ":exit"] = time.perf_counter()
                phases[label] += 1e3 * (marks[label + ":exit"] - t)
        setattr(obj, name, timed)
        wrapped.append((obj, name, f))
    marks: dict[str, float] = {}

    def timed_request(prompt_, tag: str) -> tuple[float, float, float]:
        """(TTFT, host time before the first kernel is launched, host time after the sampled token
        reached the host) of one request, in ms, from the wrapped methods' first entry / last exit."""
        marks.clear()
        wall = _ttft(llm_sx, prompt_, tag)[0]
        t0 = marks["add_request:enter"]
        return 1e3 * wall, 1e3 * (marks["  model.forward (host):enter"] - t0), \
            1e3 * (t0 + wall - marks["  sample (host, waits for the GPU):exit"])
    for obj, name, label in ((eng, "add_request", "add_request"), (eng.scheduler, "schedule", "schedule (plan)"),
                             (runner, "launch", "runner.launch"), (runner, "collect", "runner.collect"), (StepBlend, "_copy_reused", "  blend copy plan"),
                             (StepBlend, "_probe", "  probe (host)"), (StepBlend, "select", "  select (host)"),
                             (runner.model, "forward", "  model.forward (host)"),
                             (eng.registrar, "register", "register segments"),
                             (eng.kv, "cache_blocks", "cache_blocks"), (eng.kv, "cache_approx_blocks", "cache_approx_blocks"),
                             (runner, "_collect_sample", "  sample (host, waits for the GPU)")):
        wrap(obj, name, label)
    sys_ids, plen, rows, out = rand_ids(40), SIZES["passage_len"], [], []
    for k in sorted({SIZES["passages"][min(1, len(SIZES["passages"]) - 1)], SIZES["passages"][-1]}):
        passages = [rand_ids(plen) for _ in range(k)]
        prompt = lambda r, q: {"segments": [sys_ids] + [passages[(i + r) % k] for i in range(k)] + [q]}
        llm_sx.reset_cache()
        _ttft(llm_sx, prompt(0, rand_ids(48)), f"bp-prime{k}")
        _ttft(llm_sx, prompt(1, rand_ids(48)), f"bp-warm{k}")
        phases.clear()
        timed3 = [timed_request(prompt(r, rand_ids(48)), f"bp{k}-{r}") for r in (2, 3, 4)]
        walls = [t[0] / 1e3 for t in timed3]
        lead_ms, tail_ms = statistics.median(t[1] for t in timed3), statistics.median(t[2] for t in timed3)
        host = {key: v / 3 for key, v in phases.items()}
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _ttft(llm_sx, prompt(5, rand_ids(48)), f"bp{k}-prof")
        tl = _gpu_timeline(prof)
        wall = 1e3 * statistics.median(walls)
        out.append({"passages": k, "wall_ms": wall, "host_lead_ms": lead_ms, "host_tail_ms": tail_ms,
                    "host_ms": host, "gpu": tl, "kernels_ms": kernel_split(prof),
                    "top_kernels": _top_kernels(prof)})
        log(f"blendprof {k}: {out[-1]}")
        rows.append([f"{k} x {plen}", f"{wall:.1f}", f"{lead_ms:.1f} / {tail_ms:.1f}", " / ".join(f"{key.strip()} {v:.1f}" for key, v in host.items()),
                     f"{tl.get('span_ms', 0):.1f} / {tl.get('busy_ms', 0):.1f} / {tl.get('idle_ms', 0):.1f}",
                     str(tl.get("largest_gaps", [])[:3])])
    for obj, name, f in wrapped:
        if isinstance(obj, type):
            setattr(obj, name, f)           # a class's method (StepBlend: one instance per step)
        else:
            delattr(obj, name)
    table("Blended prefill: host phases (ms, mean of 3) and the GPU timeline of one profiled request",
          ["prompt", "TTFT ms", "host before the first kernel / after the sampled token ms", "host phases ms", "GPU span / busy / idle ms", "largest GPU gaps (ms, before, after)"], rows)
    RESULTS["blend_profile"] = out


def section_syncs(llm_sx: LLM, reuse: dict | None = None, label: str = "default") -> None:
    """Every host<-device synchronisation of one blended request (8 passages cached in another
    order; `reuse`: per-request knob overrides), with the engine frames that made it: torch's sync
    debug mode turns each into a warning. The step should sync only where the host truly needs
    device data (the sampled token)."""
    import collections
    import traceback
    import warnings
    found: collections.Counter = collections.Counter()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def record(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if os.path.abspath(f.filename).startswith(os.path.join(root, "sparsex"))] or stack[-4:]
        found[" <- ".join(f"{os.path.relpath(os.path.abspath(f.filename), root)}:{f.lineno} {f.name}"
                          for f in reversed(frames[-3:]))] += 1

    sys_ids, plen, k = rand_ids(40), SIZES["passage_len"], SIZES["passages"][0]
    passages = [rand_ids(plen) for _ in range(k)]
    prompt = lambda r: {"segments": [sys_ids] + [passages[(i + r) % k] for i in range(k)] + [rand_ids(48)]}
    llm_sx.reset_cache()
    _ttft(llm_sx, prompt(0), "sync-prime")
    _ttft(llm_sx, prompt(1), "sync-warm")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _ttft(llm_sx, prompt(2), f"sync-run-{label}", reuse=reuse)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    rows = [[where or "(outside the engine)", str(n)] for where, n in found.most_common()]
    table(f"Host-device syncs of one blended request ({k} passages x {plen} tokens, cached in another order; "
          f"knobs: {label})", ["engine frames (innermost first)", "syncs"], rows or [["none", "0"]])
    RESULTS.setdefault("syncs", {})[label] = dict(found)


# ------------------------------------------------------------------------------ SmolLM2 (real weights)
def section_smol() -> None:
    from transformers import AutoModelForCausalLM
    data = json.load(open(os.path.join(os.path.dirname(__file__), "..", "tests", "data", "smollm2_greedy_cpu.json")))
    cases = data["cases"]
    n_new = data["max_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    llm32 = LLM(device="cuda", dtype="float32", cache="none")
    outs = llm32.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in cases], params, use_tqdm=False)
    gpu = [o.outputs[0].token_ids for o in outs]
    from sparsex.models.loader import load_model
    model_dir = load_model("smollm2-135m-instruct").model_dir
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEV).eval()
    hf_tokens = []
    with torch.inference_mode():
        for c in cases:
            ids = torch.tensor([c["prompt_token_ids"]], device=DEV)
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            hf_tokens.append(g[0, ids.shape[1]:].tolist())
    same_cpu = sum(g == c["greedy"] for g, c in zip(gpu, cases))
    same_hf = sum(g == h for g, h in zip(gpu, hf_tokens))
    first_div = [next((i for i, (a, b) in enumerate(zip(g, h)) if a != b), None) for g, h in zip(gpu, hf_tokens)]
    # bf16 vs fp32, teacher-forced on prompt + fp32 continuation: top-1 at every position
    llm16 = LLM(device="cuda", dtype="bfloat16", cache="none")
    tf = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    agree = total = 0
    for c, g in zip(cases, gpu):
        seq = {"prompt_token_ids": c["prompt_token_ids"] + g}
        top = []
        for llm in (llm32, llm16):
            o = llm.generate(seq, tf, use_tqdm=False)[0]
            top.append([max(d.items(), key=lambda kv: kv[1])[0] for d in o.prompt_logprobs[1:]])
        agree += sum(a == b for a, b in zip(*top))
        total += len(top[0])
    table("SmolLM2-135M-Instruct on the GPU (real weights)",
          ["check", "result"],
          [["fp32 greedy == CPU path (tests/data)", f"{same_cpu}/{len(cases)} prompts, {n_new} tokens each"],
           ["fp32 greedy == transformers (GPU, fp32)", f"{same_hf}/{len(cases)} (first divergence: {first_div})"],
           ["bf16 teacher-forced top-1 agreement with fp32", f"{agree / total:.4f} over {total} positions"]])
    RESULTS["smol"] = {"same_cpu": same_cpu, "same_hf": same_hf, "cases": len(cases), "first_div": first_div,
                       "bf16_top1_agreement": agree / total, "positions": total}


OUT = None


def _dry_run_setup() -> None:
    """CPU smoke run of this script's own code (tiny random model, tiny sizes, fake CUDA events)."""
    global DEV, MODEL, MAX_LEN
    from sparsex.models import dummy
    base = dummy.dummy_shape_of(MODEL)
    shape = dict(dummy.DUMMY_SHAPES[base], hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152)
    if "layer_types" in shape:
        shape.update(layer_types=shape["layer_types"][2:6], sliding_window=48)
    if "num_experts" in shape:
        shape.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    dummy.DUMMY_SHAPES[f"tiny-{base}"] = shape
    DEV, MODEL, MAX_LEN = torch.device("cpu"), f"dummy:tiny-{base}", 1024
    SIZES.update(prefill=((64, 1, 2), (128, 1, 1)), profile=64, decode_batches=(1, 3), decode_ctx=40,
                 passages=(4, 5), passage_len=64, span_passages=(5,))   # >= min_blend_tokens hit tokens: the dry run blends

    class FakeEvent:
        def __init__(self, **kw):
            self.t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1e3 * (other.t - self.t)
    torch.cuda.Event = FakeEvent
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.set_sync_debug_mode = lambda *a: None
    torch.cuda.get_device_name = lambda *a: "cpu (dry run)"
    # hf_from_ours copies our plain weights into transformers' model; CPU prepacking would drop them
    from sparsex.engine import model_runner
    model_runner.prepack_supported = lambda device, dtype: False


def _parse_variants(text: str) -> list[tuple[str, dict]]:
    """'a=1,b=0.5;c=2' -> [("a=1,b=0.5", {"a": 1, "b": 0.5}), ("c=2", {"c": 2})], each value typed
    as its ReuseConfig field."""
    return [(spec, dict(parse_knob(item.strip(), spec, positional=True) for item in spec.split(",")))
            for spec in filter(None, (x.strip() for x in text.split(";")))]


def main() -> None:
    global OUT, GC_FREEZE, MODEL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="ceil,prefill,decode,blend")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke run of the script (tiny model)")
    ap.add_argument("--model", default=MODEL,
                    help="dummy:<shape> whose random weights the speed sections run, e.g. dummy:qwen3-8b, "
                         "dummy:gemma3-12b, dummy:qwen3-30b-a3b (models/dummy.py lists the shapes)")
    ap.add_argument("--kv-gib", type=float, default=20.0,
                    help="KV pool of the cache='none' engine (prefill, decode sections), GiB; the MoE shape's "
                         "61 GB of bf16 weights leave less room on an 80 GB card")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="move every object alive after the engines are built out of the cyclic GC's reach "
                         "(gc.freeze), so a collection walks only what requests allocate")
    ap.add_argument("--variants", default="",
                    help="blend section: more sparsex knob sets, each replayed like the default, e.g. "
                         "'rescore_layers=2,candidate_ratio=0.5;recompute_ratio=0.2'")
    ap.add_argument("--no-prefix-engine", action="store_true",
                    help="blend section: run the none and sparsex engines only (no prefix-caching column), "
                         "for a model whose three pools and weights pass the card's memory")
    ap.add_argument("--passages", default="",
                    help="blend section: passages per prompt, e.g. '16' or '16,64' (default: 8,16,32,64)")
    args = ap.parse_args()
    GC_FREEZE = args.gc_freeze
    MODEL = args.model
    if args.passages:
        SIZES["passages"] = tuple(int(x) for x in args.passages.split(","))
    if args.dry_run:
        _dry_run_setup()
    OUT = args.out
    if OUT:
        os.makedirs(OUT, exist_ok=True)
    sections = args.sections.split(",")
    log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    _patch_dummy_tokenizer()
    try:
        if "smol" in sections:
            section_smol()
        if any(s in sections for s in ("ceil", "prefill", "decode", "decodeprof", "blend", "blendprof", "syncs",
                                        "spans")):
            ceil = section_ceil()
            llm_none = make_llm("none", args.kv_gib if DEV.type == "cuda" else 0.05)
            hf = None
            if "prefill" in sections or "decode" in sections:
                hf = hf_from_ours(llm_none.llm_engine.runner.model, llm_none.llm_engine.runner.model_config)
            if "prefill" in sections:
                section_prefill(llm_none, hf, ceil)
            if "decode" in sections:
                section_decode(llm_none, hf, ceil)
            if "decodeprof" in sections:
                section_decode_profile(llm_none, ceil)
            del hf
            torch.cuda.empty_cache()
            # the prefix engine holds one longest request; the sparsex engine that plus every passage's
            # segment entry (Gemma-3-12B's 393 KB of KV per token needs ~13 GiB per 33k-token request)
            prefix_gib, sx_gib = _blend_pool_gib(llm_none)
            if "blend" in sections:
                llm_prefix = None if args.no_prefix_engine else make_llm("prefix", prefix_gib, share_from=llm_none)
                llm_sx = make_llm("sparsex", sx_gib, share_from=llm_none)
                section_blend(llm_none, llm_prefix, llm_sx, [("default", None)] + _parse_variants(args.variants))
            if "spans" in sections:
                llm_sx = llm_sx if "blend" in sections else make_llm("sparsex", sx_gib, share_from=llm_none)
                section_spans(llm_none, llm_sx)
            if "blendprof" in sections or "syncs" in sections:
                llm_sx = llm_sx if ("blend" in sections or "spans" in sections) else make_llm("sparsex", sx_gib, share_from=llm_none)
                if "blendprof" in sections:
                    section_blend_profile(llm_sx)
                if "syncs" in sections:
                    for label, rv in [("default", None)] + _parse_variants(args.variants):
                        section_syncs(llm_sx, rv, label)
    finally:
        if OUT:
            with open(os.path.join(OUT, "gpu_engine.json"), "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()

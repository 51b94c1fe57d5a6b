"""Runs one scheduler step on the model: builds the flat batch and attention metadata, applies
segment-reuse plans (KV copy + row selection), runs the forward, samples, computes logprobs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparsex.config import EngineConfig
from sparsex.engine.forward_context import ForwardContext
from sparsex.engine.scheduler import SchedulerOutput
from sparsex.layers.attention_backend import TorchAttentionBackend
from sparsex.layers.attention_metadata import AttentionMetadata
from sparsex.layers.sampler import Sampler, SamplingBatch, compute_topk_logprobs, token_logprobs
from sparsex.models.llama import LlamaForCausalLM
from sparsex.models.loader import LoadedModel
from sparsex.models.qwen2 import Qwen2ForCausalLM

_ARCHITECTURES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
_LOGITS_CHUNK = 512          # rows of prompt logits materialised at once (vocab-wide)


@dataclass
class RequestStepResult:
    sampled_token: int | None = None
    logprobs: dict[int, float] | None = None
    prompt_logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (position, dict)


@dataclass
class StepTimings:
    forward_s: float = 0.0
    kv_copy_s: float = 0.0
    selection_s: float = 0.0


@torch.no_grad()
def _init_random(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _attention_backend(device: torch.device):
    if device.type == "cuda":
        from sparsex.layers.triton_attention import TritonAttentionBackend
        return TritonAttentionBackend
    return TorchAttentionBackend


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        cfg = loaded.config
        self.model_config = cfg
        with torch.device("meta"):
            model = _ARCHITECTURES[cfg.architecture](cfg, max_model_len)
        if loaded.weights:
            model = model.to_empty(device="cpu")
            model.load_hf_weights(loaded.weights)
            model = model.to(device=self.device, dtype=self.dtype)
        else:                                   # dummy weights: drawn on the device, in the target dtype
            model = model.to_empty(device=self.device).to(self.dtype)
            _init_random(model, config.seed)
        model.rotary.build(self.device)         # float32 tables, rebuilt after the cast
        self.model = model.eval()
        self.backend = _attention_backend(self.device)
        self.sampler = Sampler()
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        shape = (self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]
        self.blender = None          # sparsex.segment.blender.Blender, set by the engine when reuse is on
        # evaluation hook (fidelity benchmarks/tests): request_id -> positions whose full next-token
        # log-distribution is kept in `captured_logprobs[request_id][position]` ([vocab] float32, CPU)
        self.capture_positions: dict[str, set[int]] = {}
        self.captured_logprobs: dict[str, dict[int, torch.Tensor]] = {}
        self.timings = StepTimings()

    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def _num_blocks(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        n = self.config.kv_cache_memory // self.bytes_per_block()
        if n < 1:
            raise ValueError(f"kv_cache_memory={self.config.kv_cache_memory} bytes holds no block "
                             f"({self.bytes_per_block()} bytes each)")
        return int(n)

    def _capture(self, sched, cu, positions, hidden, row_of) -> None:
        for si, s in enumerate(sched.scheduled):
            want = self.capture_positions.get(s.request.request_id)
            if not want:
                continue
            got = self.captured_logprobs.setdefault(s.request.request_id, {})
            for r in range(cu[si], cu[si + 1]):
                h = r if row_of is None else row_of.get(r)
                if positions[r] in want and h is not None:
                    got[positions[r]] = torch.log_softmax(self.model.compute_logits(hidden[h:h + 1]).float(), -1)[0].cpu()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, RequestStepResult]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []          # row (in the full batch) whose logits are sampled, per sampling seq
        sample_reqs = []
        bs = self.block_size
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            toks = req.all_token_ids
            table = [b.block_id for b in req.blocks]
            for p in range(start, end):
                input_ids.append(toks[p])
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            cu.append(len(input_ids))
            seq_lens.append(end)
            tables.append(table)
            if end == req.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
        max_blocks = max(len(t) for t in tables)
        dev = self.device
        md = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev),
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
            max_seq_len=max(seq_lens),
            cu_seqlens_q_cpu=cu,
            seq_lens_cpu=seq_lens,
        )
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.kv_caches, backend=self.backend)
        if self.blender is not None and any(s.reuse_plan is not None for s in sched.scheduled):
            self.blender.prepare(sched, ctx, self)
        t0 = time.perf_counter()
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        hidden = self.model(ids_t, md.positions, ctx)                   # [kept_rows, hidden]
        # map full-batch row -> row of `hidden`
        if ctx.kept_rows is None:
            row_of = None
        else:
            row_of = {int(r): i for i, r in enumerate(ctx.kept_rows.tolist())}

        results: dict[str, RequestStepResult] = {s.request.request_id: RequestStepResult() for s in sched.scheduled}
        if self.capture_positions:
            self._capture(sched, cu, positions, hidden, row_of)
        # prompt logprobs: every computed row that predicts a prompt token
        for si, s in enumerate(sched.scheduled):
            req = s.request
            if req.params.prompt_logprobs is None:
                continue
            rows, targets, pos_list = [], [], []
            for r in range(cu[si], cu[si + 1]):
                p = positions[r]
                if p + 1 >= req.num_prompt_tokens:
                    continue
                h = r if row_of is None else row_of.get(r)
                if h is None:
                    continue                      # a reused row not recomputed: no logits for it
                rows.append(h)
                targets.append(req.prompt_token_ids[p + 1])
                pos_list.append(p + 1)
            k = req.params.prompt_logprobs
            for c in range(0, len(rows), _LOGITS_CHUNK):
                logits = self.model.compute_logits(hidden[rows[c:c + _LOGITS_CHUNK]]).float()
                tgt = torch.tensor(targets[c:c + _LOGITS_CHUNK], device=dev)
                lp_t = token_logprobs(logits, tgt).tolist()
                if k > 0:
                    ids, lps = compute_topk_logprobs(logits, k)
                    ids, lps = ids.tolist(), lps.tolist()
                for j, pos in enumerate(pos_list[c:c + _LOGITS_CHUNK]):
                    d = {targets[c + j]: lp_t[j]}
                    if k > 0:
                        d.update({i: lp for i, lp in zip(ids[j], lps[j]) if i not in d})
                    results[req.request_id].prompt_logprobs.append((pos, d))

        if sample_reqs:
            rows = sample_rows if row_of is None else [row_of[r] for r in sample_rows]
            logits = self.model.compute_logits(hidden[rows]).float()    # [num_sampled, vocab]
            batch = SamplingBatch.from_params([r.params for r in sample_reqs], [r.generator for r in sample_reqs], dev)
            out = self.sampler(logits, batch)
            tokens = out.sampled_token_ids.tolist()
            sampled_lp = out.sampled_logprobs.tolist() if out.sampled_logprobs is not None else None
            top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
            top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
            for j, req in enumerate(sample_reqs):
                res = results[req.request_id]
                res.sampled_token = tokens[j]
                k = req.params.logprobs
                if k is not None and sampled_lp is not None:
                    d = {tokens[j]: sampled_lp[j]}
                    if top_ids is not None:
                        for i, lp in zip(top_ids[j][:k], top_lps[j][:k]):
                            d.setdefault(i, lp)
                    res.logprobs = d
        self.timings.forward_s += time.perf_counter() - t0
        return results

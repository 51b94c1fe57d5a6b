"""Runs one scheduler step on the model: builds the flat batch and attention metadata, applies
segment-reuse plans (KV copy + row selection), runs the forward, samples, computes logprobs.

On CUDA the step's index arrays are built on the host and reach the device in one non_blocking
copy (`host_inputs.py`); the only host-device sync of a step is reading the sampled tokens (a
blended prefill's selection stays on the device: segment/step_blend.py). Steps made only of one-row decodes
replay a CUDA graph (`cuda_graph.py`) unless `EngineConfig.enforce_eager` is set.

A step is two calls, so the engine's host bookkeeping overlaps the device work:
    launch(sched)  -> LaunchedStep   every kernel up to the sampled tokens launched (no sync)
    collect(step)  -> results        the sampled tokens read back (the step's one device->host sync)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
import numpy as np
import torch

from sparsex.cache.device_kv import DeviceKV
from sparsex.cache.slot_mapping import slot_mapping, slot_of
from sparsex.config import EngineConfig
from sparsex.engine.cuda_graph import BATCH_SIZES, DecodeGraphs
from sparsex.layers.forward_context import ForwardContext
from sparsex.engine.host_inputs import BlockTables, PinnedUploader
from sparsex.engine.structured_output import StructuredOutputManager
from sparsex.request import Request
from sparsex.engine.scheduler import SchedulerOutput
from sparsex.segment.step_blend import BlendResult, LayerPointerCache, StepBlend
from sparsex.layers import cpu_kernels
from sparsex.layers.attention_backend import TorchAttentionBackend
from sparsex.layers.attention_backend_protocol import AttentionBackend
from sparsex.layers.attention_metadata import AttentionMetadata
from sparsex.layers.tensor_parallel import TensorParallelGroup
from sparsex.models.moe import SparseMoeBlock
from sparsex.layers.packed_linear import prepack_supported
from sparsex.layers.sampler import Sampler, SamplerOutput, SamplingBatch, compute_topk_logprobs, token_logprobs
from sparsex.models.decoder import DecoderForCausalLM
from sparsex.models.loader import LoadedModel
from sparsex.models.weight_sharding import shard_hf_weights

_LOGITS_CHUNK = 512          # rows of prompt logits materialised at once (vocab-wide)


@dataclass
class RequestStepResult:
    sampled_token: int | None = None
    logprobs: dict[int, float] | None = None
    prompt_logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (position, dict)
    distributions: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, [vocab] log-probs)
    blend: BlendResult | None = None        # a blended prefill's outcome (segment/step_blend.py)


@dataclass
class StepTimings:
    """Host seconds, summed over steps. On the GPU the blend's are launch time (the kernels run
    asynchronously), not device time."""
    forward_s: float = 0.0          # from the forward's launch to the sampled tokens
    blend_copy_s: float = 0.0       # building and launching blended requests' KV copies
    selection_s: float = 0.0        # blended requests' probes and row selections


@torch.no_grad()
def _init_random(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from sparsex.layers.triton_attention import TritonAttentionBackend
        return TritonAttentionBackend
    return TorchAttentionBackend


class ModelRunner:
    """`tp`: this process's rank of a tensor-parallel group (engine/tp_executor.py); every rank
    runs `launch` on the same step, and only rank 0 samples."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int,
                 structured_output: StructuredOutputManager | None = None,
                 tp: TensorParallelGroup | None = None):
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.structured_output = structured_output      # the sampled rows' token bitmasks (None: no grammars)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        cfg = loaded.config
        self.model_config = cfg
        with torch.device("meta"):
            model = DecoderForCausalLM(cfg, max_model_len, self.tp)
        weights = loaded.weights
        if self.tp is not None and weights:
            weights = shard_hf_weights(weights, cfg, self.tp)
        if weights:
            model = model.to_empty(device="cpu")
            model.load_hf_weights(weights)
            model = model.to(device=self.device, dtype=self.dtype)
        else:                                   # dummy weights: drawn on the device, in the target dtype
            # (under TP every rank draws its shard from the same seed: the ranks' shapes are equal, so
            # the parameters every rank holds whole, such as a router, come out equal; the model is
            # not TP=1's, which speed work does not need)
            model = model.to_empty(device=self.device).to(self.dtype)
            _init_random(model, config.seed)
        del weights
        model.build_rotary(self.device)         # float32 tables, rebuilt after the cast
        if prepack_supported(self.device, self.dtype):
            model.prepack_for_cpu()
        if self.device.type == "cpu":
            cpu_kernels.native()                # built (first run on a machine) or loaded now, not in the first step
        self.model = model.eval()
        self.backend = _attention_backend(self.device)
        self.sampler = Sampler()
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]
        # blended prefills (segment/step_blend.py): the `random` selector's generator, reseeded with
        # the engine's cache state (`reset_blend_state`), and the CUDA copy's address tables
        self.selection_generator = torch.Generator().manual_seed(config.seed)
        self.layer_pointers = LayerPointerCache()
        self.timings = StepTimings()
        self.max_model_len = max_model_len
        self.uploader = PinnedUploader(self.device)
        self.block_tables = BlockTables()
        # an MoE block on its per-expert loop (fp32, or no grouped GEMM) reads counts on the host: no graphs
        self.graphs_capturable = all(m.graph_capturable(self.device, self.dtype) for m in self.model.modules()
                                     if isinstance(m, SparseMoeBlock))
        if self.tp is not None:
            self.graphs_capturable = False      # decode graphs with collectives inside are not captured yet
        self.score_reducer = self._score_reducer()
        self.decode_graphs: DecodeGraphs | None = None

    def close(self) -> None:
        """Nothing to release (the tensor-parallel executor stops its ranks here)."""

    def reset_blend_state(self) -> None:
        """Reseed what blended prefills draw from and zero the timings (the engine's cache reset)."""
        self.selection_generator = torch.Generator().manual_seed(self.config.seed)
        self.timings = StepTimings()

    def device_kv(self) -> DeviceKV:
        """The KV caches as the segment registrar and store write them."""
        return DeviceKV(kv_caches=self.kv_caches, block_size=self.block_size, device=self.device, dtype=self.dtype,
                        bytes_per_token=self.bytes_per_block() // self.block_size, upload=self.uploader.upload,
                        layer_inv_freqs=lambda: self.model.layer_inv_freqs())

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them without tensor parallelism)."""
        return self.model.layers[0].self_attn.num_kv_heads

    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def _num_blocks(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        n = self.config.kv_cache_memory // self.bytes_per_block()
        if n < 1:
            raise ValueError(f"kv_cache_memory={self.config.kv_cache_memory} bytes holds no block "
                             f"({self.bytes_per_block()} bytes each)")
        return int(n)

    def _distributions(self, sched, cu, positions, hidden, row_of, results) -> None:
        """SamplingParams.distributions_from: each computed row at or after that position, as its
        full next-token log-distribution (a reused row dropped before the last layer has none)."""
        for si, s in enumerate(sched.scheduled):
            start = s.request.params.distributions_from
            if start is None:
                continue
            out = results[s.request.request_id].distributions
            for r in range(cu[si], cu[si + 1]):
                h = r if row_of is None else row_of.get(r)
                if positions[r] >= start and h is not None:
                    out.append((positions[r], torch.log_softmax(self.model.compute_logits(hidden[h:h + 1]).float(), -1)[0].cpu()))

    def _host_inputs(self, sched: SchedulerOutput) -> _StepInputs:
        """Every index array of the step, in numpy (no device work): rows of all sequences, flat."""
        bs = self.block_size
        step = _StepInputs()
        ids, pos, slots = [], [], []                 # per sequence: arrays, or scalars for one-row decodes
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            table = self.block_tables.get(req)
            if end - start == 1:
                ids.append(_token_at(req, start))
                pos.append(start)
                slots.append(slot_of(table, start, bs))
            else:
                p = np.arange(start, end, dtype=np.int64)
                ids.append(np.asarray(_token_slice(req, start, end), dtype=np.int64))
                pos.append(p)
                slots.append(slot_mapping(table, p, bs))
            step.cu.append(step.cu[-1] + end - start)
            step.seq_lens.append(end)
            step.tables.append(table)
            if end == req.num_tokens:
                step.sample_rows.append(step.cu[-1] - 1)
                step.sample_reqs.append(req)
        if all(isinstance(x, int) for x in pos):    # a pure decode step: one row per sequence
            step.ids, step.positions, step.slots = (np.array(x, dtype=np.int64) for x in (ids, pos, slots))
        else:
            flat = lambda xs: np.concatenate([np.atleast_1d(np.asarray(x, dtype=np.int64)) for x in xs])
            step.ids, step.positions, step.slots = flat(ids), flat(pos), flat(slots)
        return step

    def _graph_ok(self, sched: SchedulerOutput) -> bool:
        """CUDA graphs only for steps whose every request is a one-row decode and nothing blends."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.graphs_capturable:
            return False
        if any(s.request.params.distributions_from is not None for s in sched.scheduled):
            return False          # a graph computes the sampled rows' logits only
        if len(sched.scheduled) > min(self.config.max_num_seqs, BATCH_SIZES[-1]):
            return False
        return all(s.num_new_tokens == 1 and s.reuse_plan is None
                   and s.request.num_computed_tokens >= s.request.num_prompt_tokens for s in sched.scheduled)

    def execute(self, sched: SchedulerOutput) -> dict[str, RequestStepResult]:
        """Run one step to its results (`launch` then `collect`, nothing in between)."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> dict[str, RequestStepResult]:
        """The launched step's sampled tokens (and logprobs), read back: the step's one device->host sync."""
        if step.sampled is not None:
            self._collect_sample(step.sample_reqs, step.sampled, step.results)
        self.timings.forward_s += time.perf_counter() - step.t0
        return step.results

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Launch one step: the forward and the sampling of every request whose last scheduled row
        is its last token, without waiting for the sampled tokens (`collect` reads them). Host work
        done between the two costs no time on the GPU; on the CPU the forward has already run."""
        step = self._host_inputs(sched)
        results: dict[str, RequestStepResult] = {s.request.request_id: RequestStepResult() for s in sched.scheduled}
        if self._graph_ok(sched):
            t0 = time.perf_counter()
            if self.decode_graphs is None:
                self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs,
                                                  self.max_model_len, self.uploader)
            logits = self.decode_graphs.run(step.ids, step.positions, step.slots, step.seq_lens, step.tables)
            return LaunchedStep(results, step.sample_reqs, self._launch_sample(step.sample_reqs, logits.float()), t0)

        cu, seq_lens = step.cu, step.seq_lens
        max_blocks = max(t.shape[0] for t in step.tables)
        tables = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)      # [num_seqs, max_blocks], 0-padded
        for i, t in enumerate(step.tables):
            tables[i, :t.shape[0]] = t
        ids_t, pos_t, slot_t, cu_t, lens_t, tables_t, sample_t = self.uploader.upload([
            step.ids, step.positions, step.slots, np.asarray(cu, dtype=np.int32),
            np.asarray(seq_lens, dtype=np.int32), tables, np.asarray(step.sample_rows, dtype=np.int64)])
        md = AttentionMetadata(
            positions=pos_t,
            slot_mapping=slot_t,
            cu_seqlens_q=cu_t,
            seq_lens=lens_t,
            block_tables=tables_t,
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
            max_seq_len=max(seq_lens),
            cu_seqlens_q_cpu=cu,
            seq_lens_cpu=seq_lens,
        )
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.kv_caches, backend=self.backend)
        blend = None
        if any(s.reuse_plan is not None for s in sched.scheduled):
            blend = StepBlend(sched, ctx, self.model.layer_inv_freqs(), self.uploader, self.layer_pointers,
                              self.selection_generator, self.score_reducer,
                              None if self.tp is None else self.tp.same_on_all_ranks)
        t0 = time.perf_counter()
        hidden = self.model(ids_t, md.positions, ctx)                   # [kept_rows, hidden]
        if blend is not None:                   # every selection ran inside the forward: host counts
            for rid, blended in blend.results().items():
                results[rid].blend = blended
            self.timings.blend_copy_s += blend.copy_seconds
            self.timings.selection_s += blend.selection_seconds
        want_distributions = any(s.request.params.distributions_from is not None for s in sched.scheduled)
        need_positions = want_distributions or any(s.request.params.prompt_logprobs is not None
                                                   for s in sched.scheduled)
        # map full-batch row -> row of `hidden` (a device read: only when rows other than the
        # sampled ones are needed)
        row_of = None
        if ctx.kept_rows is not None and need_positions:
            row_of = {int(r): i for i, r in enumerate(ctx.kept_rows.tolist())}
        positions = step.positions.tolist() if need_positions else None
        if want_distributions:
            self._distributions(sched, cu, positions, hidden, row_of, results)
        # prompt logprobs: every computed row that predicts a prompt token
        dev = self.device
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

        sampled = None
        if step.sample_reqs:
            if ctx.kept_rows is not None:
                # a sampled row is a new token, never dropped: its place among the kept rows, on the device
                sample_t = torch.searchsorted(ctx.kept_rows, sample_t)
            sampled_hidden = hidden.index_select(0, sample_t)
            logits = self.model.compute_logits(sampled_hidden).float()    # [num_sampled, vocab]
            if self.tp is not None and self.tp.rank != 0:
                return LaunchedStep(results, [], None, t0)      # rank 0 samples; the others only helped gather
            sampled = self._launch_sample(step.sample_reqs, logits)
        return LaunchedStep(results, step.sample_reqs, sampled, t0)

    def _score_reducer(self):
        """Under TP: what makes a blended request's selection scores the whole model's on every rank
        (StepBlend.reduce_scores), so every rank keeps the same rows."""
        if self.tp is None:
            return None
        tp, replication = self.tp, self.tp.kv_replication(self.model_config.num_key_value_heads)

        def reduce(deviation: torch.Tensor | None, mass: torch.Tensor | None):
            # deviation: a sum over KV heads (a replicated head is counted once); mass: a mean over
            # query heads, which every rank holds as many of. One all-reduce for both.
            parts = [x.float() for x in (deviation, mass) if x is not None]
            joint = tp.all_reduce(torch.cat(parts))
            n = deviation.numel() if deviation is not None else 0
            dev = joint[:n] / replication if deviation is not None else None
            return dev, (joint[n:] / tp.size if mass is not None else None)
        return reduce

    def _launch_sample(self, reqs: list[Request], logits: torch.Tensor) -> SamplerOutput:
        """Launch the sampling of one token per request from logits [len(reqs), vocab] (no sync)."""
        batch = SamplingBatch.from_params([r.params for r in reqs], [r.generator for r in reqs], "cpu")
        if self.device.type != "cpu" and not batch.all_greedy:
            # greedy rows only take an argmax; the knob tensors travel only when some row samples
            for name in ("temperature", "top_p", "top_k", "min_p"):
                setattr(batch, name, getattr(batch, name).to(self.device, non_blocking=True))
        if batch.logit_bias is not None:
            batch.logit_bias = batch.logit_bias.to(self.device)
        if self.structured_output is not None:
            # filled on the host from each row's matcher (advanced by the previous step's token), uploaded non_blocking
            batch.token_bitmask = self.structured_output.grammar_bitmask([r.grammar for r in reqs])
        return self.sampler(logits, batch)

    def _collect_sample(self, reqs: list[Request], out: SamplerOutput, results: dict[str, RequestStepResult]) -> None:
        """The sampled tokens (and logprobs) to the host: the step's one device->host sync."""
        tokens = out.sampled_token_ids.tolist()
        sampled_lp = out.sampled_logprobs.tolist() if out.sampled_logprobs is not None else None
        top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
        top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
        for j, req in enumerate(reqs):
            res = results[req.request_id]
            res.sampled_token = tokens[j]
            k = req.params.logprobs
            if k is not None and sampled_lp is not None:
                d = {tokens[j]: sampled_lp[j]}
                if top_ids is not None:
                    for i, lp in zip(top_ids[j][:k], top_lps[j][:k]):
                        d.setdefault(i, lp)
                res.logprobs = d


@dataclass
class LaunchedStep:
    """A step whose kernels are launched: what `ModelRunner.collect` needs to finish it."""
    results: dict[str, RequestStepResult]    # by request id; prompt logprobs, distributions, blend filled in
    sample_reqs: list[Request]               # the requests whose sampled tokens are in flight
    sampled: SamplerOutput | None            # None: no request samples this step
    t0: float                                # perf_counter at the forward's launch (StepTimings.forward_s)


@dataclass
class _StepInputs:
    """Host-side (numpy / lists) inputs of one step; rows of sequence i are cu[i]:cu[i+1]."""
    ids: np.ndarray = None              # [num_rows] int64
    positions: np.ndarray = None        # [num_rows] int64
    slots: np.ndarray = None            # [num_rows] int64
    cu: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    tables: list[np.ndarray] = field(default_factory=list)     # per sequence: block ids, int32
    sample_rows: list[int] = field(default_factory=list)       # row whose logits are sampled, per sampling seq
    sample_reqs: list[Request] = field(default_factory=list)


def _token_at(req: Request, p: int) -> int:
    n = req.num_prompt_tokens
    return req.prompt_token_ids[p] if p < n else req.output_token_ids[p - n]


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """Token ids at positions start..end-1 without building prompt + output (all_token_ids) first."""
    n = req.num_prompt_tokens
    if end <= n:
        return req.prompt_token_ids[start:end]
    if start >= n:
        return req.output_token_ids[start - n:end - n]
    return req.prompt_token_ids[start:] + req.output_token_ids[:end - n]

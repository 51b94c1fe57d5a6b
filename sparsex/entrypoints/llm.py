"""The offline API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from sparsex.config import EngineConfig, ReuseConfig
from sparsex.engine.llm_engine import LLMEngine
from sparsex.outputs import RequestOutput
from sparsex.sampling_params import SamplingParams


_R = ReuseConfig()      # the segment-reuse defaults, one source: config.ReuseConfig


class LLM:
    """llm = LLM(model="smollm2-135m-instruct", dtype="float32", cache="prefix", seed=0)

    cache: "none" (no reuse) | "prefix" (exact prefix caching) | "sparsex" (prefix + segment reuse).
    Segment-reuse knobs: full_layers, recompute_ratio, selector, boundary_tokens, boundary_share, min_segment_tokens,
    min_context_tokens, min_blend_tokens, rescore_layers, candidate_ratio, approx_prefix, merge_encodings
    (per call also `blend`: generate(..., reuse={"blend": False}) computes exactly and merges, an ingestion pass).
    warmup: run a few small requests at start-up so the first real one compiles nothing
    (None: on for CUDA, off for the CPU).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", *, dtype: str = "float32", cache: str = "prefix",
                 seed: int = 0, device: str = "cpu", block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int = 1 << 30, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 64,
                 full_layers: int = _R.full_layers, recompute_ratio: float = _R.recompute_ratio,
                 selector: str = _R.selector, boundary_tokens: int = _R.boundary_tokens,
                 boundary_share: float = _R.boundary_share, min_segment_tokens: int = _R.min_segment_tokens,
                 min_context_tokens: int = _R.min_context_tokens, min_blend_tokens: int = _R.min_blend_tokens,
                 rescore_layers: int | None = _R.rescore_layers, candidate_ratio: float = _R.candidate_ratio,
                 approx_prefix: bool = _R.approx_prefix, merge_encodings: int = _R.merge_encodings,
                 segment_eviction: str = "frequency", cache_dir: str | None = None, warmup: bool | None = None):
        reuse = ReuseConfig(full_layers=full_layers, recompute_ratio=recompute_ratio, selector=selector,
                            boundary_tokens=boundary_tokens, boundary_share=boundary_share,
                            min_segment_tokens=min_segment_tokens,
                            min_context_tokens=min_context_tokens, min_blend_tokens=min_blend_tokens,
                            rescore_layers=rescore_layers, candidate_ratio=candidate_ratio,
                            approx_prefix=approx_prefix, merge_encodings=merge_encodings)
        self.config = EngineConfig(model=model, dtype=dtype, device=device, cache=cache, seed=seed,
                                   block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                                   max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, segment_eviction=segment_eviction, reuse=reuse,
                                   cache_dir=cache_dir, warmup=warmup)
        self.llm_engine = LLMEngine(self.config)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_cache(self) -> None:
        self.llm_engine.reset_cache()

    def generate(self, prompts: Any | Sequence[Any], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, reuse: dict | None = None) -> list[RequestOutput]:
        """prompts: a str, {"prompt_token_ids": [...]}, {"segments": [...]} (optionally with "cache_salt"), or a list of them.
        All prompts are validated before any is queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params(sampling_params, len(prompts))
        tokenized = [self.llm_engine.tokenize(p) for p in prompts]
        return self._run(tokenized, params, use_tqdm, reuse)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, cache_salt: str | None = None,
             tools: list[dict] | None = None, reuse: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template.
        Each message's content is a reusable segment."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params(sampling_params, len(convs))
        tokenized = [self.llm_engine.chat_to_prompt(c, add_generation_prompt, cache_salt, tools) for c in convs]
        return self._run(tokenized, params, use_tqdm, reuse)

    @staticmethod
    def _params(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return sp

    def _run(self, tokenized, params, use_tqdm: bool, reuse: dict | None) -> list[RequestOutput]:
        engine = self.llm_engine
        # validate everything before queuing anything
        for tp, p in zip(tokenized, params):
            p.verify()
            if len(tp.token_ids) >= engine.max_model_len:
                raise ValueError(f"prompt has {len(tp.token_ids)} tokens; max_model_len is {engine.max_model_len}")
        ids = []
        try:
            for tp, p in zip(tokenized, params):
                rid = str(next(self._counter))
                engine.add_request(rid, tp, p, reuse=reuse)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

"""The offline API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from sparsex.config import EngineConfig
from sparsex.engine.llm_engine import LLMEngine
from sparsex.entrypoints import tool_parsers as tp
from sparsex.entrypoints.ingest import INGEST_PARAMS, IngestParams, IngestResult, ingest_result, plan_ingest
from sparsex.outputs import RequestOutput
from sparsex.reuse_profiles import ReuseProfiles, engine_config, find_reuse_profiles
from sparsex.sampling_params import SamplingParams


class LLM:
    """An engine in this process: `LLM(model, **knobs)`.

        llm = LLM()                                   # SmolLM2-135M-Instruct, cache="sparsex", dtype="auto"
        llm = LLM("smollm2-135m-instruct", cache="prefix", dtype="float32", recompute_ratio=0.2)

    Every keyword is a field of EngineConfig or ReuseConfig (sparsex/config.py); docs/configuration.md
    lists them all with defaults and when to change them. The everyday ones:

      cache: "sparsex" (prefix caching + segment reuse, default) | "prefix" (exact prefix caching) | "none"
      dtype: "auto" (bfloat16 where it runs natively, else float32) | "float32" | "bfloat16" | "float16"
      device: "cpu" | "cuda" | "cuda:N";   seed;   enforce_eager (CUDA: decode without graph replay)
      memory and length: num_blocks or kv_cache_memory (bytes), max_model_len, max_num_seqs,
          max_num_batched_tokens
      segment reuse: reuse_profile ("fast" | "default" | "quality"), or recompute_ratio, full_layers,
          selector (explicit knobs win over the profile)
      quality_sample: share of blended requests whose answers are scored against full prefill after each
          `generate` call (llm_engine.quality_monitor.results); quality_target: a KL those scores hold by
          moving recompute_ratio (llm_engine.ratio_controller.ratio)
      reuse_profile_file: the profiles' knobs from this `sparsex calibrate` file; unset = the model's
          calibrated file in the profile dir if there is one, else the built-in profiles; "none" = built-in
          (sparsex/reuse_profiles.py; `self.reuse_profiles` says which table is in force)

    An unknown keyword raises TypeError naming it and listing the valid ones. Per call,
    `generate(..., reuse={...})` overrides segment-reuse knobs for those prompts; `ingest` computes
    a corpus's segments ahead of the requests that will reuse them.
    """

    def __init__(self, model: str = EngineConfig.model, *, reuse_profile_file: str | None = None, **knobs: Any):
        self.reuse_profiles = ReuseProfiles.builtin()
        if knobs.get("cache", EngineConfig.cache) == "sparsex":       # only segment reuse reads profiles
            self.reuse_profiles = find_reuse_profiles(model, reuse_profile_file, seed=knobs.get("seed", EngineConfig.seed))
        self.config = engine_config(self.reuse_profiles, model=model, **knobs)
        self.llm_engine = LLMEngine(self.config, self.reuse_profiles)
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
             tools: list[dict] | None = None, reuse: dict | None = None, tool_choice: str | dict | None = None,
             tool_parser: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template.
        Each message's content is a reusable segment.

        `tools` (OpenAI's function tools) are rendered by the chat template; unless `tool_choice` is
        "none", each answer's calls are parsed into `CompletionOutput.tool_calls` (and the text before
        them into `.content`) by `tool_parser` (a convention of sparsex.entrypoints.tool_parsers; default:
        detected from the chat template). `tool_choice` "required" or {"type": "function", "function":
        {"name": ...}} constrains decoding to a valid call (needs the engine's structured outputs)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params(sampling_params, len(convs))
        parser = None
        tool_choice = tp.effective_tool_choice(tools, tool_choice)
        tp.check_tools(tools, tool_choice)
        if tools and tool_choice != "none":
            parser = tp.resolve_parser(tool_parser, self.llm_engine.tokenizer.chat_template)
            if parser is None:
                raise ValueError("this model's chat template has no tool-call convention sparsex recognises: pass "
                                 f"tool_parser= (one of {', '.join(tp.PARSER_NAMES)}), or tool_choice='none'")
            if tp.is_forcing(tool_choice):
                params = [tp.constrain_to_tool_calls(p, parser, tools, tool_choice) for p in params]
        tokenized = [self.llm_engine.chat_to_prompt(c, add_generation_prompt, cache_salt, tools) for c in convs]
        outputs = self._run(tokenized, params, use_tqdm, reuse)
        if parser is not None:
            for out in outputs:
                for c in out.outputs:
                    c.content, c.tool_calls = parser.extract(c.text)
        return outputs

    def ingest(self, segments: Sequence[str], *, prefix: str | None = None, cache_salt: str | None = None,
               passes: int = IngestParams.passes, group_size: int = IngestParams.group_size,
               seed: int = IngestParams.seed, use_tqdm: bool = False) -> IngestResult:
        """Compute `segments` (a corpus's passages) ahead of the prompts that will reuse them, in
        any order and position: prompts of `group_size` segments after `prefix` (the application's
        system prompt or preamble, if any; at least `min_context_tokens` long lets every segment be
        reused anywhere), pass 1 in order, passes 2..`passes` in seeded shuffles computed exactly, so
        each index entry becomes the mean of its encodings. `cache_salt`: the namespace the entries
        belong to (later prompts must carry the same salt to reuse them). Defaults and bounds:
        IngestParams."""
        engine = self.llm_engine
        params = IngestParams(passes=passes, group_size=group_size, seed=seed)
        plan = plan_ingest(engine, segments, prefix=prefix, cache_salt=cache_salt, params=params)
        outputs: list[RequestOutput] = []
        for prompts, reuse in zip(plan.passes, plan.reuse):
            outputs += self._run(prompts, [INGEST_PARAMS] * len(prompts), use_tqdm, reuse)
        return ingest_result(engine, plan, outputs)

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
            if p.structured_outputs is not None:       # a schema that does not compile fails here (then cached)
                engine.structured_output.compile(p.structured_outputs)
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
        engine.run_quality_checks()          # quality_sample: the batch is done, the engine is idle
        return [results[i] for i in ids]

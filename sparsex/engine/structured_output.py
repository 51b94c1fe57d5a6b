"""Structured outputs (vLLM v1's `StructuredOutputManager`): the output must match a JSON schema, any
JSON object or an EBNF grammar, through xgrammar.

    manager = StructuredOutputManager(tokenizer, vocab_size, eos_token_ids, device)
    grammar = manager.grammar_for(spec)     # LLMEngine.add_request: compiles, or hits the cache;
                                            # StructuredOutputError (a ValueError) before anything is queued
    bitmask = manager.grammar_bitmask(reqs) # ModelRunner, per sampling step: [len(reqs), words] int32
                                            # on the device, or None when no row is constrained
    grammar.accept(token)                   # LLMEngine._append_token, once per sampled token

A compiled grammar depends only on the spec (and the tokenizer), so it is compiled once and kept in
an LRU cache keyed by the spec's compact text; each request (each choice of an n > 1 request)
gets its own `xgrammar.GrammarMatcher` over it, held by the request (`Request.grammar`) and dropped
with it: finishing or aborting a request frees nothing here. A preempted request keeps its output
tokens (it is recomputed, not resampled), so its matcher needs no rollback.

The bitmask: bit t of row r (word t // 32, bit t % 32) set = token t allowed for that row; an
unconstrained row is all ones. The matcher's stop tokens are the engine's EOS ids, so EOS is
allowed exactly when the grammar may end. The mask is filled on the host (xgrammar's matcher is
host code) into one reused buffer, pinned on CUDA, and uploaded with one non_blocking copy: no host
sync; the sampler applies it on the device (layers/token_bitmask.py).

xgrammar is imported at the first structured request: an engine that never gets one does not need it.
"""
from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sparsex.sampling_params import InvalidParamError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

BITS_PER_WORD = 32
# A spec longer than this (schema JSON text or EBNF, in characters) is refused before compiling:
# compile time and grammar memory grow with it, and no real response format comes close.
MAX_SPEC_CHARS = 64 * 1024
# A compiled grammar larger than this (xgrammar's memory_size_bytes) is refused and not cached.
MAX_GRAMMAR_BYTES = 64 * 1024 * 1024
# Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " (and sometimes "Check failed: ...")
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class StructuredOutputError(InvalidParamError):
    """A spec that cannot be served; `code` says how (the server's 400 error code)."""

    def __init__(self, message: str, code: str = "invalid_structured_output"):
        super().__init__(message, param="structured_outputs", code=code)


@dataclass(frozen=True)
class GrammarKey:
    """The compile cache's key: what kind of spec, and its compact text."""
    kind: str         # "json" | "json_object" | "grammar"
    text: str         # a schema's compact JSON (its key order kept), the EBNF as given, "" for json_object

    @classmethod
    def of(cls, spec: StructuredOutputsParams) -> GrammarKey:
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            try:
                # key order kept: xgrammar emits an object's properties in the schema's order
                text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise StructuredOutputError(f"the JSON schema is not serialisable as JSON: {e}",
                                            code="invalid_json_schema") from None
            return cls("json", text)
        if spec.json_object:
            return cls("json_object", "")
        return cls("grammar", spec.grammar)


class RequestGrammar:
    """One request's position in its grammar (an `xgrammar.GrammarMatcher`). Written only by
    `LLMEngine` (`accept`, once per sampled token); read by the manager when it fills the bitmask."""

    def __init__(self, key: GrammarKey, matcher: "xgrammar.GrammarMatcher"):
        self.key = key
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the request is then ended)."""
        return self.matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted): nothing more may be generated."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Owns the grammar compiler, its cache and the bitmask buffers; one per engine."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device,
                 max_threads: int = 4):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size                       # the logits' width (may exceed the tokenizer's)
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.max_threads = max_threads
        self.num_words = -(-vocab_size // BITS_PER_WORD)   # bitmask words per row
        self._compiler: "xgrammar.GrammarCompiler | None" = None     # made at the first structured request
        self._cache: OrderedDict[GrammarKey, "xgrammar.CompiledGrammar"] = OrderedDict()
        self.num_compiles = 0                              # cache misses that compiled (successfully or not)
        self.num_cache_hits = 0
        self._host: torch.Tensor | None = None             # [rows, num_words] int32, pinned on CUDA
        self._copied: torch.cuda.Event | None = None       # fires once the last upload has read `_host`

    # ---- compiling ------------------------------------------------------------------------------
    def _get_compiler(self) -> "xgrammar.GrammarCompiler":
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as e:
                raise StructuredOutputError(f"structured outputs need the xgrammar package ({e}): "
                                            f"pip install xgrammar", code="structured_outputs_unavailable") from None
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.eos_token_ids) or None)
            # our own cache (by the spec's text) replaces xgrammar's, so a grammar is held once
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> tuple[GrammarKey, "xgrammar.CompiledGrammar"]:
        """The compiled grammar of a spec, from the cache or compiled now; StructuredOutputError
        naming the problem (nothing is cached for a spec that fails)."""
        spec.verify()
        key = GrammarKey.of(spec)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return key, compiled
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "grammar": "grammar"}[key.kind]
        code = "invalid_json_schema" if key.kind == "json" else "invalid_grammar"
        if len(key.text) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"the {what} is too large: {len(key.text)} characters (at most "
                                        f"{MAX_SPEC_CHARS})", code="grammar_too_large")
        compiler = self._get_compiler()
        self.num_compiles += 1
        try:
            if key.kind == "json":
                # compact separators (", ", ": "), no free whitespace: a small model cannot loop on
                # blank space, and the output still parses as the schema says. strict_mode: no
                # properties or items beyond the schema's unless it allows them explicitly.
                compiled = compiler.compile_json_schema(key.text, any_whitespace=False, strict_mode=True)
            elif key.kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            else:
                compiled = compiler.compile_grammar(key.text)
        except Exception as e:      # noqa: BLE001 - whatever xgrammar raises on a spec is the spec's fault
            raise StructuredOutputError(f"invalid {what}: {_xgrammar_message(e)}", code=code) from None
        if compiled.memory_size_bytes > MAX_GRAMMAR_BYTES:
            raise StructuredOutputError(f"the {what} compiles to a grammar too large: {compiled.memory_size_bytes} "
                                        f"bytes (at most {MAX_GRAMMAR_BYTES})", code="grammar_too_large")
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return key, compiled

    def grammar_for(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request (each choice of an n > 1 request gets its own)."""
        import xgrammar as xgr
        key, compiled = self.compile(spec)
        # the stop tokens are the engine's EOS ids (the tokenizer info's): EOS only where the grammar may end
        return RequestGrammar(key, xgr.GrammarMatcher(compiled))

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    # ---- the per-step bitmask -------------------------------------------------------------------
    def grammar_bitmask(self, grammars: list[RequestGrammar | None]) -> torch.Tensor | None:
        """The step's token bitmask for rows whose grammars are given (None: an unconstrained row),
        on the engine's device: [len(grammars), num_words] int32. None when no row is constrained."""
        if all(g is None for g in grammars):
            return None
        rows = len(grammars)
        host = self._reserve(rows)[:rows]
        host.fill_(-1)                                     # every bit set: free rows allow everything
        for row, g in enumerate(grammars):
            if g is not None:
                g.fill_bitmask(host, row)
        if self.device.type != "cuda":
            return host                                    # the CPU sampler is done with it before the next fill
        dev = host.to(self.device, non_blocking=True)      # pinned -> device, no host sync
        self._copied.record()
        return dev

    def _reserve(self, rows: int) -> torch.Tensor:
        # on CUDA the previous upload must have read the buffer before it is refilled; a step that
        # samples has synced on its tokens already, so this does not wait in practice
        if self._copied is not None:
            self._copied.synchronize()
        if self._host is None or self._host.shape[0] < rows:
            n = max(rows, 16, 0 if self._host is None else 2 * self._host.shape[0])
            pin = self.device.type == "cuda"
            self._host = torch.empty((n, self.num_words), dtype=torch.int32, pin_memory=pin)
            self._copied = torch.cuda.Event() if pin else None
        return self._host


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's error text without its source-location prefix and trailing noise."""
    lines = [_XGR_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line)[:500] or type(e).__name__

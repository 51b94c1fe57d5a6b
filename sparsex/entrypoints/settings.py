"""HTTP-layer settings of `sparsex serve` (the engine's own knobs live in EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None                # when set, /v1/* and /tokenize need `Authorization: Bearer <key>`
    tenant_header: str | None = None          # request header naming the tenant; overrides the body's cache_salt
    allow_shared_segments: bool = False       # accept content parts with cache_segment.scope == "shared"
    # accept a body's `reuse` (per-request segment-reuse knobs). Off: a client could otherwise change
    # what the shared segment index keeps (blend=false, merge_encodings) or lower everyone's fidelity
    # floor for its own requests; ingestion has its own endpoint, POST /v1/segments
    allow_reuse_overrides: bool = False
    served_model_name: str | None = None      # the `model` clients must name (default: the engine's model name)
    tool_call_parser: str | None = None       # tool-call convention (tool_parsers.PARSERS); None: from the chat template
    retry_after_s: int = 1                    # Retry-After on 503 queue-full answers
    shutdown_engine: bool = True              # stop (drain) the engine when the app shuts down

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string (or None for no authentication)")
        if self.tenant_header is not None and not self.tenant_header.strip():
            raise ValueError("tenant_header must be a header name (or None)")
        if self.tool_call_parser is not None:
            from sparsex.entrypoints.tool_parsers import get_parser
            get_parser(self.tool_call_parser)           # ValueError naming the known parsers
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")

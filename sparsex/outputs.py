"""What the engine returns (vLLM's `RequestOutput` shape)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class ToolCall:
    """A function call parsed from a chat answer (`LLM.chat(..., tools=...)`, the server's `tool_calls`)."""
    id: str
    name: str
    arguments: str                             # the arguments as a JSON text, as OpenAI sends them


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None    # one dict per generated token: top-k + the sampled token
    finish_reason: str | None                  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None       # the stop string / token id that ended it
    # LLM.chat with tools: the calls parsed from `text` (None: not parsed), and the text before them
    tool_calls: list[ToolCall] | None = None
    content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


TRANSPARENT_SOURCES = ("indexed", "request")     # ReusedSpan sources found by content


@dataclass(frozen=True)
class ReusedSpan:
    """A prompt span whose KV came from the cache instead of a fresh prefill: prompt positions
    [start, end), and where it came from, re-rotated to this position unless said otherwise:
      "segment"        an explicit segment of the prompt (message, `segments` piece) found whole in
                       the segment index;
      "indexed"        found by content inside a segment-index entry (transparent segments);
      "request"        found by content in the exact cached KV of an earlier request (transparent);
      "approx_prefix"  blocks an earlier blended request left, continuing the exact prefix as they are."""
    start: int
    end: int
    source: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0        # exact prefix-cache hit tokens
    num_reused_tokens: int = 0        # tokens served from the segment cache (before recomputation)
    num_recomputed_tokens: int = 0    # reused tokens that were recomputed
    num_candidate_tokens: int = 0     # two-stage selection: reused tokens computed up to the re-scoring
                                      # layer (>= num_recomputed_tokens); with one stage, equal to it
    reused_spans: list[ReusedSpan] = field(default_factory=list)   # where num_reused_tokens sit in the prompt
    # why indexed segments were found but not reused (e.g. "hits below min_blend_tokens (200 < 256)");
    # None when everything found was reused, or nothing was found
    reuse_skipped: str | None = None
    # SamplingParams.distributions_from: position -> the full next-token log-distribution there
    # ([vocab] float32, CPU), on the finished output; a reused row that was not recomputed has none
    distributions: dict[int, torch.Tensor] | None = None

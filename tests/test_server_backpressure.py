"""Server behaviour that depends on engine state a real model cannot be pinned in: a full queue,
a crashed engine loop, shutdown with requests in flight. A scripted engine stands in for
LLMEngine (same interface), so every state is reached deterministically, with no timing."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from sparsex.engine.llm_engine import EngineStats
from sparsex.config import EngineConfig
from sparsex.entrypoints.async_engine import AsyncLLM, EngineClosedError
from sparsex.entrypoints.background_server import BackgroundServer
from sparsex.inputs import TokenizedPrompt
from sparsex.entrypoints.openai_server import build_app
from sparsex.entrypoints.settings import ServerSettings
from sparsex.outputs import CompletionOutput, RequestMetrics, RequestOutput

pytestmark = pytest.mark.unit

MODEL = "scripted"


@dataclass
class _Req:
    rid: str
    max_tokens: int
    arrival: float
    tokens: list[int] = field(default_factory=list)


class ScriptedEngine:
    """Admits at most `capacity` requests to running; each step gives every running request one
    token ("x"), until its max_tokens. `fail` makes the next step raise."""

    model_name = MODEL
    max_model_len = 128
    tokenizer = None
    config = EngineConfig(cache="prefix")      # what AsyncLLM reads: no segment reuse, so no reuse metrics
    quality_monitor = None

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self.fail = False
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._lock = threading.Lock()      # the test thread changes `capacity` / `fail`

    def tokenize(self, prompt) -> TokenizedPrompt:
        return TokenizedPrompt([1, 2, 3], "abc")

    def chat_to_prompt(self, messages, add_generation_prompt=True, cache_salt=None, tools=None) -> TokenizedPrompt:
        return TokenizedPrompt([1, 2, 3], "abc", cache_salt=cache_salt)

    def add_request(self, request_id, prompt, params, arrival_time=None, reuse=None) -> None:
        self.waiting.append(_Req(request_id, params.max_tokens or 4, arrival_time or time.time()))

    def abort_request(self, ids) -> None:
        ids = {ids} if isinstance(ids, str) else set(ids)
        self.waiting = [r for r in self.waiting if r.rid not in ids]
        self.running = [r for r in self.running if r.rid not in ids]

    closed = False

    def close(self) -> None:
        self.closed = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)        # a stub step: keep the engine loop from spinning a core
        with self._lock:
            if self.fail:
                raise RuntimeError("scripted engine failure")
            while self.waiting and len(self.running) < self.capacity:
                self.running.append(self.waiting.pop(0))
        outs = []
        for r in list(self.running):
            r.tokens.append(87)
            done = len(r.tokens) >= r.max_tokens
            if done:
                self.running.remove(r)
            comp = CompletionOutput(0, "x" * len(r.tokens), list(r.tokens), None, "length" if done else None)
            outs.append(RequestOutput(r.rid, "abc", [1, 2, 3], None, [comp], done, RequestMetrics(r.arrival)))
        return outs

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting), kv_cache_usage=0.0,
                           num_blocks=1, prefix_cache_queries=0, prefix_cache_hits=0)


def _client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kw)


def test_queue_full_is_503_with_retry_after():
    engine = ScriptedEngine(capacity=0)           # nothing is admitted: every request waits
    llm = AsyncLLM(engine, max_queued_requests=2)
    with BackgroundServer(build_app(llm, ServerSettings(retry_after_s=3))) as srv:
        client = _client(srv)
        # a streaming response starts only once the engine accepted the request
        held = [_chat(client, max_tokens=2, stream=True) for _ in range(2)]
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "server_error" and err["message"]
        with pytest.raises(openai.InternalServerError) as exc:     # the SDK's view of the same 503
            _chat(client, max_tokens=2)
        assert exc.value.status_code == 503
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'sparsex:request_rejected_total{model_name="scripted",reason="queue_full"} 2.0' in metrics
        with engine._lock:
            engine.capacity = 8                    # let the held ones run to completion
        for s in held:
            assert [c.choices[0].finish_reason for c in s if c.choices][-1] == "length"
        assert _chat(client, max_tokens=2).choices[0].finish_reason == "length"


def test_engine_death_is_503_and_health_fails():
    engine = ScriptedEngine()
    llm = AsyncLLM(engine)
    with BackgroundServer(build_app(llm)) as srv:
        client = _client(srv)
        assert httpx.get(srv.url + "/health").status_code == 200
        stream = _chat(client, max_tokens=1000, stream=True)
        first = next(iter(stream))                  # running
        assert first.choices[0].delta.role == "assistant"
        with engine._lock:
            engine.fail = True
        # the stream ends with an in-band error event (headers were long sent)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "died" in health.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_shutdown_drains_in_flight_requests():
    """What SIGTERM does: uvicorn stops accepting and waits for in-flight responses, then the app's
    shutdown drains the engine; the in-flight stream still ends normally."""
    engine = ScriptedEngine()
    llm = AsyncLLM(engine)
    srv = BackgroundServer(build_app(llm))
    stream = _chat(_client(srv), max_tokens=40, stream=True)
    chunks = iter(stream)
    next(chunks)
    srv.stop()                                      # returns once uvicorn and the engine are done
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in rest) == "x" * 40
    assert not srv.running and not llm.is_running and llm.error is None
    assert engine.closed                            # the engine was closed (the shared store flushed)
    with pytest.raises(EngineClosedError):
        llm.call_sync(lambda e: None)

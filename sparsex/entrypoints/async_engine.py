"""AsyncLLM: the (not thread-safe) LLMEngine behind an asyncio server.

One background thread, the engine loop, owns the engine: it alone calls into it (tokenizing
included, since HF tokenizers are not safe to share across threads). Everything else talks to it
through a thread-safe inbox of commands (add, abort, call, close) and gets answers back on its own
event loop via `loop.call_soon_threadsafe`.

    llm = AsyncLLM(LLMEngine(config), max_queued_requests=256)
    stream = await llm.add_request("id", "Hello", SamplingParams(max_tokens=8))   # errors raise here
    async for out in stream: ...          # cumulative RequestOutputs, the last one `finished`
    llm.abort("id")                       # thread-safe, idempotent; frees the request's blocks
    await llm.shutdown(drain=True)

The loop blocks on the inbox while the engine is idle and otherwise alternates "apply every
pending command" with one `engine.step()`, so an abort lands within one step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from sparsex.inputs import TokenizedPrompt
from sparsex.metrics import ServerMetrics
from sparsex.outputs import RequestOutput
from sparsex.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sparsex.config import EngineConfig
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.reuse_profiles import ReuseProfiles

logger = logging.getLogger(__name__)
T = TypeVar("T")

# What add_request accepts as a prompt: anything LLMEngine.tokenize takes, a TokenizedPrompt, or a
# function that builds one on the engine thread (e.g. `lambda e: e.chat_to_prompt(messages)`).
PromptSource = Any


class EngineDeadError(RuntimeError):
    """The engine loop crashed; no request can be served any more."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down (or shut down) and takes no new requests."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished."""


class PromptError(ValueError):
    """Building the prompt failed on user input (chat template error, bad segments, ...)."""


class RequestStream:
    """One request's outputs. Outputs are cumulative, so a consumer that falls behind skips to
    the latest one instead of letting a backlog build up."""

    def __init__(self, request_id: str, owner: AsyncLLM):
        self.request_id = request_id
        self.prompt: TokenizedPrompt | None = None       # set once the engine accepted the request
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _push(self, item: RequestOutput | BaseException) -> None:    # on the consumer's loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (safe to call any number of times)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


# ---- inbox commands ---------------------------------------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt: PromptSource
    params: SamplingParams
    arrival_time: float
    reuse: dict | None
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    result: concurrent.futures.Future


@dataclass
class _Wake:
    """Sent by shutdown so an idle loop notices `_closing`."""


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():              # the waiter was cancelled (client gone); the add path aborts it
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:        # that event loop is closed: nobody is listening any more
        pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, max_queued_requests: int | None = None,
                 metrics: ServerMetrics | None = None):
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self._engine = engine
        self.max_queued_requests = max_queued_requests
        reuse = engine.config.reuse if engine.config.enable_segment_reuse else None
        if metrics is None:
            # without segment reuse there is no profile table to report
            source = engine.reuse_profiles.source if reuse is not None else "built-in"
            store = engine.config.segment_store
            store_tier = "mooncake" if isinstance(store, str) and store.startswith("mooncake://") else "redis"
            metrics = ServerMetrics(engine.model_name, reuse=reuse, reuse_profile_source=source, store_tier=store_tier)
        self.metrics = metrics
        # immutable engine facts, safe to read from any thread
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        # a private tokenizer for the caller side (token strings of logprobs); the engine's own is
        # used by the engine thread only
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        # guards "is the loop still taking commands?" against the loop's final drain
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closing = False
        self._drain = True
        self._exited = False
        self._thread = threading.Thread(target=self._run, name="sparsex-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, reuse_profiles: ReuseProfiles | None = None, **kwargs: Any) -> AsyncLLM:
        from sparsex.engine.llm_engine import LLMEngine
        return cls(LLMEngine(config, reuse_profiles), **kwargs)

    # ---- state ------------------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        return self._error

    def join(self, timeout: float | None = None) -> None:
        """Wait until the engine loop has ended (shut down, or died: see `error`)."""
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """True while the loop is alive and takes new requests."""
        return self._thread.is_alive() and self._error is None and not self._closing

    # ---- public API (any thread / any event loop) -------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptSource, params: SamplingParams, *,
                          reuse: dict | None = None, arrival_time: float | None = None) -> RequestStream:
        """Queue a request; raises (ValueError, PromptError, QueueFullError, EngineClosedError,
        EngineDeadError) before anything is generated. Iterate the returned stream for outputs."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self)
        accepted = loop.create_future()
        self._submit(_Add(request_id, prompt, params, time.time() if arrival_time is None else arrival_time,
                          reuse, stream, loop, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)      # commands run in order: this lands after the add
            raise
        return stream

    async def generate(self, prompt: PromptSource, params: SamplingParams, request_id: str | None = None, *,
                       reuse: dict | None = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; leaving the loop early (break, cancellation) aborts the request."""
        stream = await self.add_request(request_id or uuid.uuid4().hex, prompt, params, reuse=reuse)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        try:
            self._submit(_Abort(request_id))
        except (EngineDeadError, EngineClosedError):
            pass                        # nothing runs any more: nothing to abort

    async def tokenize(self, prompt: PromptSource) -> TokenizedPrompt:
        """Build a prompt (as add_request would) without queuing it."""
        return await self.call(lambda _: self._build_prompt(prompt))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread, between steps (introspection, tokenization)."""
        return await asyncio.wrap_future(self._call(fn))

    def call_sync(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """`call` for plain threads (tests, scripts). Never from the engine thread itself."""
        return self._call(fn).result(timeout)

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with drain, finish the running ones first, else abort them."""
        self._request_close(drain)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---- plumbing ---------------------------------------------------------------------------
    def _call(self, fn: Callable[[Any], T]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, fut))
        return fut

    def _submit(self, cmd: Any) -> None:
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"the engine loop died: {self._error!r}")
            if self._exited:
                raise EngineClosedError("the engine has shut down")
            self._inbox.put(cmd)

    def _request_close(self, drain: bool) -> None:
        with self._lock:
            if self._exited or self._error is not None:
                return
            self._drain = self._drain and drain
            self._closing = True
            self._inbox.put(_Wake())

    # ---- the engine loop (engine thread only) -------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not busy and not self._closing and self._inbox.empty() and engine.quality_monitor is not None \
                        and engine.quality_monitor.pending:
                    # idle: score served answers, giving way as soon as a command arrives (quality_monitor.py)
                    self.metrics.on_quality(engine.run_quality_checks(should_yield=lambda: not self._inbox.empty()))
                    self.metrics.on_stats(engine.stats())
                    continue
                self._apply(self._take(block=not busy))
                if self._closing:
                    if not self._drain:
                        self._abort_all()
                    if not engine.has_unfinished_requests():
                        break
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._deliver(outputs, time.time())
                self.metrics.on_stats(engine.stats())
        except BaseException as e:          # noqa: BLE001 - anything here kills serving: report it
            logger.exception("engine loop died")
            self._die(e)
            return
        with self._lock:
            self._exited = True
            leftover = self._drain_inbox()
        for cmd in leftover:
            self._refuse(cmd, EngineClosedError("the engine has shut down"))
        engine.close()                      # the shared store's queued writes go out before the process ends

    def _take(self, block: bool) -> list[Any]:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _drain_inbox(self) -> list[Any]:
        return self._take(block=False)

    def _apply(self, cmds: list[Any]) -> None:
        for cmd in cmds:
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _Call):
                if cmd.result.set_running_or_notify_cancel():
                    try:
                        cmd.result.set_result(cmd.fn(self._engine))
                    except BaseException as e:    # noqa: BLE001 - handed to the caller
                        cmd.result.set_exception(e)

    def _add(self, cmd: _Add) -> None:
        engine = self._engine
        try:
            if self._closing:
                raise EngineClosedError("the server is shutting down")
            if self.max_queued_requests is not None:
                waiting = engine.stats().num_waiting
                if waiting + cmd.params.n > self.max_queued_requests:
                    self.metrics.on_rejected("queue_full")
                    raise QueueFullError(f"{waiting} requests are waiting (limit {self.max_queued_requests})")
            prompt = self._build_prompt(cmd.prompt)
            engine.add_request(cmd.request_id, prompt, cmd.params, arrival_time=cmd.arrival_time, reuse=cmd.reuse)
        except Exception as e:          # noqa: BLE001 - the caller decides what each error means
            _post(cmd.loop, _settle, cmd.accepted, None, e)
            return
        cmd.stream.prompt = prompt
        self._streams[cmd.request_id] = (cmd.stream, cmd.loop)
        self.metrics.on_added(cmd.request_id, cmd.arrival_time, len(prompt.token_ids))
        _post(cmd.loop, _settle, cmd.accepted, prompt, None)

    def _build_prompt(self, source: PromptSource) -> TokenizedPrompt:
        if isinstance(source, TokenizedPrompt):
            return source
        try:
            if callable(source):
                return source(self._engine)
            return self._engine.tokenize(source)
        except ValueError:
            raise
        except Exception as e:          # noqa: BLE001 - template / tokenizer errors come from user input
            raise PromptError(f"could not build the prompt: {e}") from e

    def _abort(self, request_id: str) -> None:
        self._engine.abort_request(request_id)
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            self.metrics.on_aborted(request_id, time.time())
            stream, loop = entry
            _post(loop, stream._push, RequestAbortedError(f"request {request_id} was aborted"))

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            self.metrics.on_output(out, now)
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream, loop = entry
            _post(loop, stream._push, out)

    def _refuse(self, cmd: Any, exc: BaseException) -> None:
        if isinstance(cmd, _Add):
            _post(cmd.loop, _settle, cmd.accepted, None, exc)
        elif isinstance(cmd, _Call):
            if cmd.result.set_running_or_notify_cancel():
                cmd.result.set_exception(exc)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            leftover = self._drain_inbox()
        dead = EngineDeadError(f"the engine loop died: {error!r}")
        for cmd in leftover:
            self._refuse(cmd, dead)
        for stream, loop in self._streams.values():
            _post(loop, stream._push, dead)
        self._streams.clear()

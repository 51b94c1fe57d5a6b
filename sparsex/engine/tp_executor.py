"""Tensor parallelism from the engine's side: rank 0's model runner plus the processes of the other
ranks (engine/tp_worker.py), behind the model runner's interface (`launch` / `collect`).

Rank 0 is the engine's own process (the others: `python -m sparsex.engine.tp_worker`): it owns the scheduler, the block pool, the prefix and segment
indexes, span search, reuse plans and sampling. Each step it broadcasts one message (engine/
tp_step.py: what changed for the scheduled requests, in a few integers per decode) over a gloo
group, then runs its own forward; every rank's forward joins the same all-reduces and the LM head's
all-gather, so rank 0 ends the step with the whole model's logits and samples alone. Nothing comes
back from the other ranks but their collectives' contributions.

Failure: a rank that exits (crash, OOM kill) is seen before the next step or as the collective
that fails; a rank that hangs makes rank 0's next collective time out after `tp_timeout`. Either
way `launch` raises `TensorParallelError` naming the ranks and their exit codes, after stopping the
rest: the engine loop dies with it, and `sparsex serve` exits (never a hang).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from sparsex.cache.device_kv import DeviceKV
from sparsex.config import EngineConfig
from sparsex.engine.model_runner import LaunchedStep, ModelRunner, RequestStepResult
from sparsex.engine.scheduler import SchedulerOutput
from sparsex.engine.structured_output import StructuredOutputManager
from sparsex.engine.tp_step import HostMove, KVMerge, StepMessage, StepMessageBuilder
from sparsex.engine.tp_worker import WorkerArgs, init_group, joined_key, loaded_key
from sparsex.models.loader import LoadedModel

logger = logging.getLogger(__name__)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int,
                 structured_output: StructuredOutputManager | None = None):
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1 needs a process of its own: this one already belongs "
                             "to a torch.distributed group (another tensor-parallel engine still open?)")
        timeout = config.tp_timeout
        self._closed = False
        self.workers: list[subprocess.Popen] = []
        # rank 0 hosts the rendezvous store; the ranks say in it when they joined and when they loaded,
        # so a rank that dies on the way is seen at once instead of after the timeout
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
        threads = max(1, torch.get_num_threads() // size) if config.device == "cpu" else 1
        # the ranks import the same sparsex as this process, wherever it was imported from
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if x)
        try:
            for r in range(1, size):
                p = subprocess.Popen([sys.executable, "-m", "sparsex.engine.tp_worker"], stdin=subprocess.PIPE, env=env)
                self.workers.append(p)
                p.stdin.write(pickle.dumps(WorkerArgs(r, size, config, max_model_len, store.port, timeout, threads)))
                p.stdin.close()
            self._wait_for(store, joined_key, timeout, "join")
            tp, self._control = init_group(config, 0, size, store, timeout)
            self.runner = ModelRunner(config, loaded, max_model_len, structured_output, tp)
            self._wait_for(store, loaded_key, timeout, "load the model")
        except BaseException as e:
            what = self._describe()
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            if isinstance(e, TensorParallelError):
                raise
            raise TensorParallelError(f"tensor-parallel start-up failed: {e!r}; {what}") from e
        self.messages = StepMessageBuilder()
        self._box: list = [None]

    def _wait_for(self, store: dist.Store, key, timeout: float, what: str) -> None:
        """Until every rank > 0 has set key(rank); raises if one exits first or time runs out."""
        deadline = time.monotonic() + timeout
        pending = list(range(1, len(self.workers) + 1))
        while pending:
            pending = [r for r in pending if not store.check([key(r)])]
            if any(p.poll() is not None for p in self.workers):
                raise TensorParallelError(f"a tensor-parallel rank exited before it could {what}: {self._describe()}")
            if pending and time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks {pending} did not {what} within {timeout:g} s")
            time.sleep(0.02)

    # ---- the model runner's interface --------------------------------------------------------
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        self._check_alive()
        try:
            self._send(self.messages.build(sched))
            return self.runner.launch(sched)
        except TensorParallelError:
            raise
        except (RuntimeError, dist.DistError) as e:
            self._fail(e)

    def collect(self, step: LaunchedStep) -> dict[str, RequestStepResult]:
        return self.runner.collect(step)

    def execute(self, sched: SchedulerOutput) -> dict[str, RequestStepResult]:
        return self.collect(self.launch(sched))

    def reset_blend_state(self) -> None:
        self.runner.reset_blend_state()
        self.messages.reset_blend_state()

    def device_kv(self) -> DeviceKV:
        """Rank 0's KV shard; a merged-encoding write or a host-tier move made with it is replayed on
        every rank."""
        return dataclasses.replace(self.runner.device_kv(), on_merge=self._on_merge, on_host=self._on_host)

    def _on_merge(self, arrays, weight: float) -> None:
        self.messages.add_kv_op(KVMerge(*(a.copy() for a in arrays), weight))

    def _on_host(self, op: str, key: str | None, slots) -> None:
        self.messages.add_kv_op(HostMove(op, key, slots))

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def timings(self):
        return self.runner.timings

    @property
    def model(self):
        return self.runner.model

    # ---- lifetime and failure ----------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Tell the other ranks to exit and wait for them (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.poll() is None for p in self.workers):
                self._send(StepMessage(stop=True))
                for p in self.workers:
                    p.wait(timeout)
        except (RuntimeError, dist.DistError, subprocess.TimeoutExpired):
            pass
        finally:
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _send(self, msg: StepMessage) -> None:
        self._box[0] = msg
        dist.broadcast_object_list(self._box, src=0, group=self._control)
        self._box[0] = None

    def _check_alive(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel group is closed")
        if any(p.poll() is not None for p in self.workers):
            self._fail(None)

    def _fail(self, error: BaseException | None):
        for p in self.workers:
            try:
                p.wait(0.5)         # a rank that is going down: let its exit code land
            except subprocess.TimeoutExpired:
                pass
        what = self._describe()
        self._closed = True
        self._kill()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:       # noqa: BLE001 - the group is broken already
                pass
        msg = f"tensor-parallel group failed: {what}"
        if error is not None:
            msg += f"; rank 0 saw: {error}"
        logger.error(msg)
        raise TensorParallelError(msg) from error

    def _describe(self) -> str:
        states = []
        for r, p in enumerate(self.workers, start=1):
            code = p.poll()
            states.append(f"rank {r} " + ("running (no answer)" if code is None else f"exited with code {code}"))
        return ", ".join(states)

    def _kill(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.kill()
        for p in self.workers:
            p.wait()

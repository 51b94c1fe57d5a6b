"""A tensor-parallel rank other than 0: a process of its own that loads its shard of the model and
runs every step's forward that rank 0's message describes (engine/tp_step.py), until told to stop
or until rank 0 goes away.

Started by `engine/tp_executor.py` as `python -m sparsex.engine.tp_worker` (no CUDA or thread
state inherited, and no re-import of the caller's script).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from sparsex.config import EngineConfig
from sparsex.layers.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)


def rank_device(config: EngineConfig, rank: int) -> str:
    """The device rank `rank` runs on: cuda:<rank> for a CUDA engine (rank 0 is the engine's own)."""
    return f"cuda:{rank}" if config.device.startswith("cuda") else "cpu"


def init_group(config: EngineConfig, rank: int, size: int, store: dist.Store,
               timeout_s: float) -> tuple[TensorParallelGroup, object]:
    """Join the process group through `store`: NCCL for tensors on CUDA (plus a gloo group for the
    step messages), gloo for both on the CPU. Returns (tensor group, control group)."""
    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank_device(config, rank))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if cuda else dist.group.WORLD
    return TensorParallelGroup(rank, size, dist.group.WORLD), control


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """What rank 0 hands a worker (pickled on its stdin)."""
    rank: int
    size: int
    config: EngineConfig
    max_model_len: int
    store_port: int
    timeout_s: float
    num_threads: int


def joined_key(rank: int) -> str:
    return f"sparsex/tp/joined/{rank}"


def loaded_key(rank: int) -> str:
    return f"sparsex/tp/loaded/{rank}"


def main() -> None:
    """`python -m sparsex.engine.tp_worker` with a pickled WorkerArgs on stdin: the process of one
    rank > 0. A process of its own (not a multiprocessing child), so the caller's script needs no
    `if __name__ == "__main__"` guard."""
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=os.environ.get("SPARSEX_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s tp-rank-{args.rank} %(name)s: %(message)s")
    torch.set_num_threads(args.num_threads)
    try:
        _serve(args)
    except BaseException:        # noqa: BLE001 - the exit code tells rank 0; the traceback goes to stderr
        logger.exception("tensor-parallel rank %d failed", args.rank)
        sys.stderr.flush()
        os._exit(1)              # no atexit handlers: a collective half-done must not hang the exit
    os._exit(0)


def _serve(a: WorkerArgs) -> None:
    from sparsex.engine.model_runner import ModelRunner
    from sparsex.engine.tp_step import HostMove, StepMirror
    from sparsex.layers.triton_rerotate import merge_rerotated_all_layers_torch
    from sparsex.models.loader import load_model

    config = dataclasses.replace(a.config, device=rank_device(a.config, a.rank))
    store = dist.TCPStore("127.0.0.1", a.store_port, a.size, is_master=False, timeout=timedelta(seconds=a.timeout_s))
    store.set(joined_key(a.rank), "1")
    tp, control = init_group(config, a.rank, a.size, store, a.timeout_s)
    loaded = load_model(config.model, dtype=torch.float32, cache_dir=config.cache_dir, seed=config.seed,
                        dummy_weights=False)
    runner = ModelRunner(config, loaded, a.max_model_len, None, tp)
    del loaded
    store.set(loaded_key(a.rank), "1")           # rank 0 may send steps
    kv = runner.device_kv()
    host = HostShards(kv)
    mirror = StepMirror()
    box: list = [None]
    while True:
        dist.broadcast_object_list(box, src=0, group=control)
        msg = box[0]
        if msg.stop:
            break
        if msg.reset_blend_state:
            runner.reset_blend_state()
        for op in msg.kv_ops:
            if isinstance(op, HostMove):
                host.apply(op)
            else:
                src, mean, dst, delta = kv.upload([op.src, op.mean, op.dst, op.delta])
                merge_rerotated_all_layers_torch(kv.kv_caches, src, mean, dst, delta, kv.layer_inv_freqs(), op.weight)
        host.end_of_moves()
        sched = mirror.apply(msg)
        if sched.scheduled:
            runner.collect(runner.launch(sched))
    dist.destroy_process_group()


class HostShards:
    """This rank's host copies of the host tier's records (rank 0's `HostTier` decides; this follows its
    moves): key -> [layers, 2, n, kv_heads, head_dim] on the host, pinned on CUDA."""

    def __init__(self, kv):
        self.kv = kv
        self.records: dict[str, torch.Tensor] = {}
        self.taken: dict[str, torch.Tensor] = {}

    def apply(self, move) -> None:
        if move.op == "spill":
            shard = self.kv.gather(torch.from_numpy(move.slots).to(self.kv.device))
            host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=self.kv.device.type == "cuda")
            self.records[move.key] = host.copy_(shard)
        elif move.op == "evict":
            self.records.pop(move.key, None)
        elif move.op == "take":
            self.taken[move.key] = self.records.pop(move.key)
        elif move.op == "install":
            self.kv.write(torch.from_numpy(move.slots).to(self.kv.device),
                          self.taken.pop(move.key).to(self.kv.device, non_blocking=True))
        elif move.op == "clear":
            self.records.clear()
            self.taken.clear()
        else:
            raise ValueError(f"unknown host-tier move {move.op!r}")

    def end_of_moves(self) -> None:
        """A record rank 0 took back but did not install (no free blocks) is gone there: drop it here."""
        self.taken.clear()


if __name__ == "__main__":
    main()

"""The `sparsex bench` commands implemented in sparsex.bench take their engine flags (--model, --dtype,
--device) from EngineConfig's declarations, as `sparsex generate` and `serve` do: the engine's
defaults and choices, in the flags and in the benchmarks' configs."""
from __future__ import annotations

import pytest

from sparsex import cli
from sparsex.bench.edit_replay import EditReplayConfig
from sparsex.bench.prefill import PrefillConfig
from sparsex.bench.replica_bench import ReplicaBenchConfig
from sparsex.bench.store_bench import StoreBenchConfig
from sparsex.bench.throughput import ThroughputConfig
from sparsex.bench.workload_config import StreamConfig, WorkloadBenchConfig
from sparsex.config import EngineConfig

pytestmark = pytest.mark.unit

# each command, with the arguments it requires, and the engine flags it has
COMMANDS = {"workload": ([], ("model", "dtype", "device")), "edit": (["--out", "x"], ("model", "dtype")),
            "replicas": ([], ("model", "dtype")), "store": ([], ("model", "dtype", "device"))}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_engine_flags_default_to_the_engine_s(command):
    required, flags = COMMANDS[command]
    args = cli.build_parser().parse_args(["bench", command, *required])
    assert {f: getattr(args, f) for f in flags} == {f: getattr(EngineConfig, f) for f in flags}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_dtype_takes_the_engine_s_choices(command, capsys):
    required, _ = COMMANDS[command]
    assert cli.build_parser().parse_args(["bench", command, *required, "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", command, *required, "--dtype", "int8"])
    assert "auto" in capsys.readouterr().err            # the usage error lists the engine's choices


@pytest.mark.parametrize("config", [WorkloadBenchConfig, StreamConfig, EditReplayConfig, ReplicaBenchConfig,
                                    StoreBenchConfig, PrefillConfig, ThroughputConfig])
def test_benchmark_configs_default_to_the_engine_s(config):
    cfg = config()
    for knob in ("model", "dtype", "device"):
        if hasattr(cfg, knob):
            assert getattr(cfg, knob) == getattr(EngineConfig, knob), knob

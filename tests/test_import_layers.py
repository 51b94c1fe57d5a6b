"""The package's layering, read from the source (no model, nothing imported).

Every import of a sparsex module counts: at module level, under `if TYPE_CHECKING:`, and inside
function and method bodies. A deferred import is still a dependency (the importer cannot run without
the imported module), and a circle hidden in a function body or behind TYPE_CHECKING still ties its
modules into one that cannot be read, tested or moved apart.

So imports only point down: the engine does not reach up into the entrypoints, the KV cache and the
models know nothing of the engine, nothing below the command line imports the benchmarks, no two
sparsex modules import each other, directly or around a cycle, and no two packages do either
(`sparsex.cache` as a whole against `sparsex.request`, say). The benchmarks (`sparsex.bench`) sit
beside the command line, not above it, and do not run the server's plumbing."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sparsex

pytestmark = pytest.mark.unit

ROOT = Path(sparsex.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("sparsex",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, name: str, is_package: bool) -> set[str]:
    """sparsex modules that `source` (module `name`) imports anywhere in its body; `from pkg import x`
    counts `pkg` and `pkg.x` (x may be a module)."""
    out: set[str] = set()
    package = name if is_package else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("sparsex"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.startswith("sparsex"):
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        imports = _imports(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {m for m in imports if m in files and m != name}
    return graph


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: every component of more than one node is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def _describe(cycles: list[list[str]], graph: dict[str, set[str]], unit=lambda m: m) -> str:
    """Each cycle and the module imports that close it (`unit`: what a node of `cycles` stands for)."""
    return "\n".join(" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
                                                    if unit(a) in c and unit(b) in c and unit(a) != unit(b))
                     for c in cycles)


def test_every_kind_of_import_is_counted():
    source = """
from typing import TYPE_CHECKING
from sparsex import config
import sparsex.outputs as outputs
if TYPE_CHECKING:
    from sparsex.request import Request
def f():
    import sparsex.inputs
class C:
    def method(self):
        from ..segment import span_index
        from .peer import run_peer
"""
    assert _imports(source, "sparsex.bench.replay", is_package=False) == {
        "sparsex", "sparsex.config", "sparsex.outputs", "sparsex.request", "sparsex.request.Request",
        "sparsex.inputs", "sparsex.segment", "sparsex.segment.span_index", "sparsex.bench.peer",
        "sparsex.bench.peer.run_peer"}


def test_the_graph_sees_the_known_edges():
    graph = _import_graph()
    assert "sparsex.request" in graph["sparsex.engine.scheduler"]              # module level
    assert "sparsex.layers.forward_context" in graph["sparsex.models.decoder"]
    assert "sparsex.bench.policies" in graph["sparsex.bench.replay"]           # under TYPE_CHECKING
    assert "sparsex.bench.fidelity" in graph["sparsex.bench.replay"]           # in a function's body


def test_lower_packages_do_not_import_upper_ones():
    lower = ("sparsex.cache", "sparsex.models", "sparsex.layers", "sparsex.segment", "sparsex.kvstore")
    forbidden = [("sparsex.engine", "sparsex.entrypoints"), ("sparsex.segment", "sparsex.entrypoints"),
                 ("sparsex.kvstore", "sparsex.entrypoints"), ("sparsex.segment", "sparsex.kvstore"),
                 ("sparsex.models", "sparsex.kvstore")]
    forbidden += [(low, "sparsex.engine") for low in lower]
    # the benchmarks, the demo and the command line are the top: nothing that serves imports them
    forbidden += [(low, top) for low in lower + ("sparsex.engine", "sparsex.entrypoints")
                  for top in ("sparsex.bench", "sparsex.demo", "sparsex.cli")]
    bad = sorted(f"{mod} imports {dep}" for mod, deps in _import_graph().items() for dep in deps
                 for low, high in forbidden if _in(mod, low) and _in(dep, high))
    assert not bad, "\n".join(bad)


def test_no_import_cycle_among_sparsex_modules():
    graph = _import_graph()
    cycles = _cycles(graph)
    assert not cycles, _describe(cycles, graph)


def _package_of(module: str) -> str:
    """A subpackage (`sparsex.cache`) stands for all its modules; a top-level module for itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (ROOT / parts[1]).is_dir() else module


def test_no_two_packages_import_each_other():
    modules = _import_graph()
    graph: dict[str, set[str]] = {}
    for mod, deps in modules.items():
        graph.setdefault(_package_of(mod), set()).update(_package_of(d) for d in deps)
    graph = {p: deps - {p} for p, deps in graph.items()}
    cycles = _cycles(graph)
    assert not cycles, _describe(cycles, modules, _package_of)


# `sparsex.bench` modules that may import an entrypoint, and why: they time the offline API itself
# (`LLM.generate`, what a user of the library calls) against transformers
BENCH_ENTRYPOINTS = {("sparsex.bench.throughput", "sparsex.entrypoints.llm"),
                     ("sparsex.bench.prefill", "sparsex.entrypoints.llm")}


def test_benchmarks_import_neither_the_command_line_nor_the_server():
    """The benchmarks drive the engine; the command line registers them (`sparsex bench ...`), never
    the reverse; a benchmark of a running server talks to it over HTTP (`sparsex bench serve`)."""
    graph = _import_graph()
    bench = {mod: deps for mod, deps in graph.items() if _in(mod, "sparsex.bench")}
    assert not [m for m, deps in bench.items() if "sparsex.cli" in deps or "sparsex.demo" in deps]
    entry = {(m, d) for m, deps in bench.items() for d in deps if _in(d, "sparsex.entrypoints")}
    assert entry == BENCH_ENTRYPOINTS, sorted(entry ^ BENCH_ENTRYPOINTS)


# `sparsex.bench` modules that no `sparsex bench` subcommand imports, and why they live there
BENCH_SCRIPTS = {"sparsex.bench.vllm_peer"}    # `--peer vllm` runs it as a file in vLLM's own virtualenv


def test_every_benchmark_module_serves_a_bench_subcommand():
    """sparsex.bench holds what `sparsex bench ...` runs; an analysis that only feeds the docs lives in
    benchmarks/ (it may import sparsex.bench, never the reverse)."""
    graph = _import_graph()
    reached, todo = set(), ["sparsex.cli"]
    while todo:
        mod = todo.pop()
        if mod not in reached:
            reached.add(mod)
            todo.extend(graph[mod])
    idle = {m for m in graph if _in(m, "sparsex.bench") and m not in reached}
    assert idle == BENCH_SCRIPTS, sorted(idle ^ BENCH_SCRIPTS)

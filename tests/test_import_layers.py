"""The package's layering, read from the source (no model, nothing imported): module-level imports
only point down. The engine does not reach up into the entrypoints, the KV cache and the models know
nothing of the engine, and no two sparsex modules import each other, directly or around a cycle
(imports under `if TYPE_CHECKING:` count: they are module level too)."""
from __future__ import annotations

import ast
from pathlib import Path

import sparsex

ROOT = Path(sparsex.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("sparsex",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """sparsex modules imported at module level (functions' bodies excluded, `if` blocks included)."""
    out: set[str] = set()
    package = name if is_package else name.rsplit(".", 1)[0]

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
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
                    out.update(f"{mod}.{a.name}" for a in node.names)   # `from pkg import module`
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return out


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        imports = _module_level_imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = {m for m in imports if m in files and m != name}
    return graph


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_the_known_edges():
    graph = _import_graph()
    assert "sparsex.request" in graph["sparsex.engine.scheduler"]
    assert "sparsex.layers.forward_context" in graph["sparsex.models.decoder"]
    assert "sparsex.inputs" in graph["sparsex.engine.llm_engine"]


def test_lower_packages_do_not_import_upper_ones():
    forbidden = [("sparsex.engine", "sparsex.entrypoints"), ("sparsex.cache", "sparsex.engine"),
                 ("sparsex.models", "sparsex.engine"), ("sparsex.layers", "sparsex.engine"),
                 ("sparsex.segment", "sparsex.engine"), ("sparsex.segment", "sparsex.entrypoints"),
                 ("sparsex.kvstore", "sparsex.engine"), ("sparsex.kvstore", "sparsex.entrypoints"),
                 ("sparsex.segment", "sparsex.kvstore"), ("sparsex.models", "sparsex.kvstore")]
    bad = sorted(f"{mod} imports {dep}" for mod, deps in _import_graph().items() for dep in deps
                 for low, high in forbidden if _in(mod, low) and _in(dep, high))
    assert not bad, "\n".join(bad)


def test_no_import_cycle_among_sparsex_modules():
    graph = _import_graph()
    # Tarjan's strongly connected components: any component of more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
    assert not cycles, cycles

"""The shape of src/kvswarm, read from its source (AST, nothing imported):

- layers meet through public names: no module imports a private name (leading underscore), or a
  private module, of another package;
- the library stays below the benchmarks: nothing outside ``kvswarm.bench`` imports it (the CLI
  names benchmark modules as strings and loads the one asked for);
- the imports form no cycle.  The graph is of module-level imports (a module's ``import`` statements
  outside functions and classes, those under ``if TYPE_CHECKING:`` left out: they never run); a
  second test adds the deferred imports inside functions.  An import of ``a.b.c`` is an edge to
  ``a.b.c`` only, not to the packages ``a`` and ``a.b`` that Python initialises on the way: a
  package's ``__init__`` importing its own modules is how it exposes them, not a cycle.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the kvswarm package."""
    out = {}
    for p in sorted((SRC / "kvswarm").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def package_of(module: str) -> str:
    """The package a module belongs to: itself for a package's ``__init__``."""
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


def _statements(body: list[ast.stmt], in_function: bool):
    """(import statement, inside a function or class) for every import in ``body``, at any depth."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            continue
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            sub = getattr(node, field, None)
            if isinstance(sub, list):
                yield from _statements([s for s in sub if isinstance(s, ast.AST)], nested)


@cache
def imports() -> list[tuple[str, str, str | None, bool]]:
    """``(importer, imported module, imported name or None, inside a function)`` for every import
    of a kvswarm module; ``from m import x`` where ``m.x`` is a module counts as importing ``m.x``."""
    mods = modules()
    out = []
    for mod, path in mods.items():
        pkg = package_of(mod)
        for node, deferred in _statements(ast.parse(path.read_text(), str(path)).body, False):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, None, deferred) for a in node.names if a.name.split(".")[0] == "kvswarm"]
                continue
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "kvswarm":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((mod, sub, None, deferred) if sub in mods else (mod, base, a.name, deferred))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_is_imported_across_packages():
    bad = []
    for mod, target, name, _ in imports():
        # The package owning what is imported: the imported module's (a native module has no .py here).
        owner = package_of(target) if target in modules() else target.rpartition(".")[0]
        private = any(map(_private, target.split("."))) or (name is not None and _private(name))
        if private and owner != package_of(mod):
            bad.append(f"{mod} imports {target}{'.' + name if name else ''}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def bench_importers() -> set[str]:
    return {mod for mod, target, _, _ in imports()
            if (target == "kvswarm.bench" or target.startswith("kvswarm.bench."))
            and not (mod == "kvswarm.bench" or mod.startswith("kvswarm.bench."))}


DEMO = "kvswarm.demo"


def test_nothing_outside_bench_imports_bench():
    assert bench_importers() == set()


def test_demo_does_not_import_bench():
    assert DEMO not in bench_importers()


def cycles(deferred: bool) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for mod, target, _, inside in imports():
        if target in graph and target != mod and (deferred or not inside):
            graph[mod].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_module_level_imports_form_no_cycle():
    assert cycles(deferred=False) == []


def test_no_cycle_with_deferred_imports():
    assert cycles(deferred=True) == []


def test_the_checks_see_what_they_check():
    """The scan finds the imports it is about: a check that reads nothing passes vacuously."""
    found = {(m, t) for m, t, _, _ in imports()}
    assert ("kvswarm.store.store", "kvswarm.catalog") in found  # module level
    assert ("kvswarm.io", "kvswarm.io.threads") in found  # deferred, inside make_engine
    assert "kvswarm.store.store" in modules() and "kvswarm.io" in modules()

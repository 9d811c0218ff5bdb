"""The shape of the source tree, read with `ast` (nothing imported, no subprocess): no import
cycle, a few loose modules, no long module, imports that point down the layers.

Every import in a module counts, wherever it is written: at the top, inside a function, under
`if TYPE_CHECKING:`. `from X import Y` is an edge to the module X.Y when there is one, else to X;
a package is its `__init__.py`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "scaletune"
MAX_LOOSE_MODULES = 6
MAX_LINES = 400

# Top to bottom; a module may import its own layer and the layers below it, never one above.
LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"remote"},  # the service's client: speaks its API, uses its vocabulary (serve.states)
    {"serve"},
    {"run"},
    {"launch", "doctor", "plan", "hf"},
    {"trainer"},
    {"strategies", "checkpoint", "models", "data", "inference", "objectives"},
    {"resolve"},
    {"env", "report", "safe_load"},
    {"config"},
    {"errors"},
    {"__init__"},  # the root package: only __version__
]


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str  # path:line of the import statement

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported}  ({self.where})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package under its own name)."""
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The module an import of `name` runs last: `name` itself, else its longest known prefix."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    """Every edge from `module` to another module of the package, from any import anywhere in it."""
    is_package = path.name == "__init__.py"
    where = path.relative_to(SRC.parent) if path.is_relative_to(SRC.parent) else path
    out: dict[tuple[str, int], Edge] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            if t != PACKAGE and not t.startswith(PACKAGE + "."):
                continue
            imported = _target(t, known)
            if imported and imported != module:
                out[imported, node.lineno] = Edge(module, imported, f"{where}:{node.lineno}")
    return list(out.values())


@cache
def graph() -> tuple[Edge, ...]:
    known = modules()
    return tuple(e for m, p in known.items() for e in imports_of(m, p, known))


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative), those of more than one module."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.importer].append(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: {top!r} is in no layer; add it to LAYERS in {Path(__file__).name}")


# ---------------------------------------------------------------------------------------------


def test_the_graph_is_read() -> None:
    """A control: the reader finds imports of each kind (top level, in a function, under
    TYPE_CHECKING, `from package import module`), so an empty graph cannot pass the tests below."""
    edges = {(e.importer, e.imported) for e in graph()}
    assert len(modules()) > 50
    assert ("scaletune.launch", "scaletune.launch.commands") in edges  # package __init__ re-export
    assert ("scaletune.launch.commands", "scaletune.errors") in edges  # top level
    assert ("scaletune.cli.launch_verbs", "scaletune.launch.commands") in edges  # inside a function


def test_imports_inside_functions_and_type_checking_count(tmp_path: Path) -> None:
    """A control for the reader itself on a made-up module."""
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from scaletune.env import DistributedEnv\n"
        "def f():\n    from scaletune import errors\n    import scaletune.config.loader\n"
        "from . import shell\n"
    )
    known = {
        "scaletune.env": src,
        "scaletune.errors": src,
        "scaletune.config": src,
        "scaletune.config.loader": src,
        "scaletune.launch.shell": src,
    }
    got = sorted(e.imported for e in imports_of("scaletune.launch.x", src, known))
    assert got == ["scaletune.config.loader", "scaletune.env", "scaletune.errors", "scaletune.launch.shell"]


def shortest_cycle(comp: set[str], edges: list[Edge]) -> list[Edge]:
    """The shortest import cycle inside one strongly connected component, as its edges."""
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if e.importer in comp and e.imported in comp:
            first.setdefault((e.importer, e.imported), e)
    succ: dict[str, list[str]] = {n: [] for n in comp}
    for a, b in first:
        succ[a].append(b)
    best: list[str] = []
    for start in sorted(comp):  # breadth first from each module back to itself
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(succ[v]):
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        cycle, v = [], parent[start]  # in a component every module lies on a cycle
        while v != start:
            cycle.append(v)
            v = parent[v]
        cycle = [start, *reversed(cycle)]
        if not best or len(cycle) < len(best):
            best = cycle
    return [first[a, b] for a, b in zip(best, [*best[1:], best[0]], strict=True)]


def test_no_import_cycles() -> None:
    edges = list(graph())
    cycles = strongly_connected(list(modules()), edges)
    lines = []
    for comp in cycles:
        lines.append(f"{len(comp)} modules import each other; a shortest cycle:")
        lines += [f"    {e}" for e in shortest_cycle(comp, edges)]
    assert not cycles, "import cycles (every import counts, in functions and TYPE_CHECKING too):\n" + "\n".join(lines)


def test_few_loose_modules() -> None:
    loose = sorted(p.name for p in (SRC / PACKAGE).glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, (
        f"{len(loose)} modules loose under src/{PACKAGE}/ (at most {MAX_LOOSE_MODULES}): {', '.join(loose)}; "
        "put the new one in the package of its layer"
    )


def test_no_long_modules() -> None:
    long = {
        str(p.relative_to(SRC.parent)): n
        for p in modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: " + ", ".join(f"{k} ({v})" for k, v in sorted(long.items()))


def test_imports_point_down_the_layers() -> None:
    upward = [e for e in graph() if layer_of(e.importer) > layer_of(e.imported)]
    order = " > ".join("/".join(sorted(layer)) for layer in LAYERS)
    assert not upward, f"imports of a higher layer (layers: {order}):\n" + "\n".join(f"    {e}" for e in upward)


def test_logging_is_configured_in_one_place() -> None:
    """Modules take `logging.getLogger(__name__)`; only env.configure_logging (called by the entry
    points) adds a handler or names the `scaletune` logger."""
    bad = []
    for name, path in modules().items():
        if name == "scaletune.env":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            attr, where = node.func.attr, f"{path.relative_to(SRC.parent)}:{node.lineno}"
            named = node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value)
            if attr in ("addHandler", "basicConfig", "dictConfig"):
                bad.append(f"{where}: {attr}()")
            elif attr == "getLogger" and (not node.args or (named and named.split(".")[0] == PACKAGE)):
                bad.append(f"{where}: getLogger({named or ''}) instead of getLogger(__name__)")
    assert not bad, "logging configured outside scaletune.env.configure_logging:\n" + "\n".join(bad)


def test_child_loggers_follow_the_rank_rule(capsys) -> None:
    """configure_logging, called twice (one handler, not two): a module's logger prints INFO with the
    `[scaletune] ` prefix on rank 0, only warnings on another rank."""
    import logging

    from scaletune import env

    parent = logging.getLogger(PACKAGE)
    saved = parent.handlers[:], parent.level, parent.propagate, env._RANK
    parent.handlers = [h for h in parent.handlers if h.get_name() != PACKAGE]  # a fresh one, on capsys' stderr
    try:
        env.configure_logging(0)
        env.configure_logging()
        child = logging.getLogger("scaletune.models.loading")
        child.info("rank 0 info")
        env.configure_logging(1)
        child.info("rank 1 info")
        child.warning("rank 1 warning")
        assert capsys.readouterr().err.splitlines() == ["[scaletune] rank 0 info", "[scaletune] rank 1 warning"]
    finally:
        handlers, level, propagate, rank = saved
        env.set_rank(rank)
        parent.handlers, parent.propagate = handlers, propagate
        parent.setLevel(level)

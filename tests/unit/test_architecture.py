"""The shape of the source tree, read with `ast` (nothing imported, no subprocess): no import
cycle, a few loose modules, imports that point down the layers, no private name imported from
another module, no long function (a short allow-list, each entry with its reason), every module
named in docs/architecture.md with what it owns; modules over MAX_LINES are listed as a prompt
(a warning), over HARD_MAX_LINES they fail.

Every import in a module counts, wherever it is written: at the top, inside a function, under
`if TYPE_CHECKING:`. `from X import Y` is an edge to the module X.Y when there is one, else to X;
a package is its `__init__.py`.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "scaletune"
DOC = SRC.parent / "docs" / "architecture.md"
MAX_LOOSE_MODULES = 6
MAX_LINES = 400  # a prompt (a warning lists the files): does the file hold one responsibility?
HARD_MAX_LINES = 600  # a failure: nothing runs away
MAX_FUNCTION_LINES = 80  # of a `def` node, decorators aside: end_lineno - lineno + 1

# "module:qualname" -> why it is longer than MAX_FUNCTION_LINES. The list only shrinks: an entry
# that no longer exceeds the limit, or names no function, fails the test too.
LONG_FUNCTIONS: dict[str, str] = {
    "scaletune.checkpoint.export:export_checkpoint": "one pass over every checkpoint format to a HF folder; not yet split",
    "scaletune.checkpoint.gguf:convert_hf_to_gguf": "the GGUF writer in one pass (metadata, tokenizer, tensors); not yet split",
    "scaletune.cli.launch_verbs:slurm": "a typer verb: 28 lines of signature, one option per line",
    "scaletune.cli.model_verbs:eval_": "a typer verb: 56 lines of signature, one option per line",
    "scaletune.cli.run_verbs:export": "a typer verb: 49 lines of signature, one option per line",
    "scaletune.cli.run_verbs:plan": "a typer verb: 26 lines of signature, one option per line; not yet split",
    "scaletune.cli.serve_verbs:serve": "a typer verb: 51 lines of signature (the policy's admin options)",
    "scaletune.doctor.system:check_nccl_env": "one check per variable, each message and fix written inline; not yet split",
    "scaletune.hf:load_model_for_training": "a public function: 34 lines of docstring for users of the HF Trainer",
    "scaletune.models.placement:resolve_device_map": "THE device_map rule: a 30-line docstring states every case",
    "scaletune.models.initialize:init_model": "a 28-line docstring (how the weights are drawn); not yet split",
    "scaletune.plan.estimates:_strategy_plan": "the bytes of every strategy in one table of cases; not yet split",
    "scaletune.strategies.deepspeed_config:deepspeed_json": "the one DeepSpeed generator, key by key, with a docstring per argument",
}

# Top to bottom; a module may import its own layer and the layers below it, never one above.
LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"remote"},  # the service's client: speaks its API, uses its vocabulary (serve.states)
    {"serve"},
    {"run"},
    {"launch", "doctor", "plan", "hf"},
    {"trainer"},
    # rollout: generation for online objectives, beside the engines it generates through.
    {"strategies", "checkpoint", "inference", "rollout"},
    # The model code apart from the parallelism: the loss and objectives read what a strategy hands
    # them (sharded logits, a context slice), never a strategy.
    {"models", "data", "objectives"},
    {"resolve"},
    # The reward functions of online RL: user-facing built-ins and their loader (config.user_code),
    # read by the preflight, the objectives and the service's policy.
    {"rewards"},
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


def from_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name a `from X import ...` in `module` (at `path`) reads from."""
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        anchor = module.split(".")
        anchor = anchor if path.name == "__init__.py" else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    """Every edge from `module` to another module of the package, from any import anywhere in it."""
    where = path.relative_to(SRC.parent) if path.is_relative_to(SRC.parent) else path
    out: dict[tuple[str, int], Edge] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(module, path, node)
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


class LongModule(UserWarning):
    """A module over MAX_LINES: a prompt to ask whether it holds one responsibility, not a failure."""


def lines_over(paths: Iterable[Path], limit: int) -> dict[Path, int]:
    return {p: n for p in paths if (n := len(p.read_text().splitlines())) > limit}


def test_long_modules_are_a_prompt_and_a_ceiling() -> None:
    """Over MAX_LINES: listed (printed, and a warning in pytest's summary), so that a split follows a
    responsibility rather than the count. Over HARD_MAX_LINES: a failure."""
    paths = list(modules().values())
    long = lines_over(paths, MAX_LINES)
    listed = ", ".join(f"{p.relative_to(SRC.parent)} ({n})" for p, n in sorted(long.items()))
    if long:
        prompt = f"modules over {MAX_LINES} lines (does each hold one responsibility?): {listed}"
        print(prompt)
        warnings.warn(prompt, LongModule, stacklevel=1)
    too_long = lines_over(paths, HARD_MAX_LINES)
    assert not too_long, f"modules over {HARD_MAX_LINES} lines (split by responsibility): " + ", ".join(
        f"{p.relative_to(SRC.parent)} ({n})" for p, n in sorted(too_long.items())
    )


def test_the_file_rules_catch_a_long_file(tmp_path: Path, monkeypatch) -> None:
    """A control on a made-up tree: a module over MAX_LINES warns (and passes), one over
    HARD_MAX_LINES fails."""
    import sys

    import pytest

    src = tmp_path / "src"
    long, runaway = src / PACKAGE / "long.py", src / PACKAGE / "runaway.py"
    long.parent.mkdir(parents=True)
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    runaway.write_text("x = 1\n" * (HARD_MAX_LINES + 1))
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "SRC", src)
    monkeypatch.setattr(here, "modules", lambda: {"scaletune.long": long})
    with pytest.warns(LongModule, match=re.escape(f"src/scaletune/long.py ({MAX_LINES + 1})")):
        test_long_modules_are_a_prompt_and_a_ceiling()
    monkeypatch.setattr(here, "modules", lambda: {"scaletune.long": long, "scaletune.runaway": runaway})
    with (
        pytest.warns(LongModule),
        pytest.raises(AssertionError, match=re.escape(f"src/scaletune/runaway.py ({HARD_MAX_LINES + 1})")),
    ):
        test_long_modules_are_a_prompt_and_a_ceiling()


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


# --- private names stay in their module ---------------------------------------------------------


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str, str, str]]:
    """(importer, defining module, name, path:line) for each `from X import _name` in `module` whose X
    is another module of the package (a package's `__init__` re-exporting its submodule's too)."""
    where = path.relative_to(SRC.parent) if path.is_relative_to(SRC.parent) else path
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = from_base(module, path, node)
        if base != PACKAGE and not base.startswith(PACKAGE + "."):
            continue
        defining = _target(base, known) or base
        out += [
            (module, defining, a.name, f"{where}:{node.lineno}")
            for a in node.names
            if is_private(a.name) and defining != module
        ]
    return out


def test_no_private_name_is_imported_from_another_module() -> None:
    """A name with a leading underscore belongs to its module: another module that needs it uses a
    public name (the defining module's interface), not the private one."""
    known = modules()
    found = [o for m, p in known.items() for o in private_imports(m, p, known)]
    assert not found, (
        "private names imported across modules (make it public where it is defined, or use a public one):\n"
        + "\n".join(
            f"    {importer} imports {name} from {defining}  ({where})" for importer, defining, name, where in found
        )
    )


def test_private_imports_are_caught(tmp_path: Path) -> None:
    """A control on made-up modules: absolute and relative imports of another module's private name,
    a package re-exporting its submodule's, are caught; dunders, public names, the module's own names
    and other packages' are not."""
    init, sub = tmp_path / "__init__.py", tmp_path / "logprobs.py"
    init.write_text(
        "from os import _exit\n"
        "from scaletune.data.build import _cache, __version__, public\n"
        "from .templates import _Encoder\n"
        "def f():\n    from scaletune.data import _own\n"
    )
    sub.write_text("from ..models.loss import IGNORE_INDEX, _decoder_and_head\n")
    known = {"scaletune.data": init, "scaletune.data.build": init, "scaletune.data.templates": init}
    known |= {"scaletune.models.loss": sub, "scaletune.objectives.logprobs": sub}
    got = [(d, n) for _, d, n, _ in private_imports("scaletune.data", init, known)]
    assert got == [("scaletune.data.build", "_cache"), ("scaletune.data.templates", "_Encoder")]
    got = [(i, d, n) for i, d, n, _ in private_imports("scaletune.objectives.logprobs", sub, known)]
    assert got == [("scaletune.objectives.logprobs", "scaletune.models.loss", "_decoder_and_head")]


# --- short functions ------------------------------------------------------------------------------


def function_lengths(path: Path) -> dict[str, int]:
    """qualname -> lines of every function in the file: methods `Class.name`, nested `outer.<locals>.inner`."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                out[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return out


def function_length_problems(lengths: dict[str, int], allowed: dict[str, str], limit: int) -> list[str]:
    """Functions over `limit` not allowed, and allowed ones that are gone or no longer over it."""
    out = [f"{k}: {n} lines" for k, n in sorted(lengths.items()) if n > limit and k not in allowed]
    out += [
        f"{k}: allowed, but {'there is no such function' if k not in lengths else f'{lengths[k]} lines now'}; "
        "take it off the list"
        for k in sorted(allowed)
        if lengths.get(k, 0) <= limit
    ]
    return out


def test_functions_are_short() -> None:
    lengths = {f"{m}:{q}": n for m, p in modules().items() for q, n in function_lengths(p).items()}
    problems = function_length_problems(lengths, LONG_FUNCTIONS, MAX_FUNCTION_LINES)
    assert not problems, (
        f"functions over {MAX_FUNCTION_LINES} lines (split by what each part does), and stale entries of "
        f"LONG_FUNCTIONS in {Path(__file__).name}:\n" + "\n".join(f"    {p}" for p in problems)
    )


def test_long_functions_are_caught(tmp_path: Path) -> None:
    """A control on a made-up module: long functions, methods and nested functions are measured and
    caught; an allow-list entry that names a short or missing function is caught too."""
    src = tmp_path / "m.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(80))  # 80 lines under the `def`: 81 in all
    deeper = "".join("    " + line for line in body.splitlines(True))
    src.write_text(
        "import functools\n\n\n@functools.cache\ndef long():\n"
        + body
        + "\n\nclass C:\n    def short(self):\n        return 1\n\n    async def long(self):\n"
        + deeper
        + "\n\ndef outer():\n    def inner():\n"
        + deeper
        + "    return inner\n"
    )
    lengths = {f"m:{q}": n for q, n in function_lengths(src).items()}
    assert lengths == {"m:long": 81, "m:C.short": 2, "m:C.long": 81, "m:outer": 83, "m:outer.<locals>.inner": 81}
    problems = function_length_problems(lengths, {"m:outer": "a reason"}, 80)
    assert [p.split(":")[1] for p in problems] == ["C.long", "long", "outer.<locals>.inner"]
    stale = function_length_problems(lengths, {"m:C.short": "r", "m:gone": "r"}, 80)
    assert [p for p in stale if "allowed" in p] == [
        "m:C.short: allowed, but 2 lines now; take it off the list",
        "m:gone: allowed, but there is no such function; take it off the list",
    ]


# --- docs/architecture.md names every module --------------------------------------------------------


def doc_entries(text: str) -> dict[str, str]:
    """The first column of the `## Modules` table -> its line. Paths are relative to src/scaletune; in
    `a/b.py, c.py` a bare name shares the folder of the one before it; a folder ends with `/`."""
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for row in section.splitlines():
        cells = row.strip().strip("|").split("|", 1)
        spans = re.findall(r"`([^`]+)`", cells[0])
        if len(cells) < 2 or not spans:
            continue
        folder = ""
        for name in (n.strip() for span in spans for n in span.split(",")):
            if "/" in name:
                folder = name.rstrip("/").rpartition("/")[0]
            elif folder:
                name = f"{folder}/{name}"
            out[name] = cells[1].strip()
    return out


def owns_nothing(path: Path) -> bool:
    """A package `__init__` of a docstring and imports (re-exports) only: its docstring is its line."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return False
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(not (isinstance(t, ast.Name) and t.id.startswith("__") and t.id.endswith("__")) for t in targets):
            return False
    return path.name == "__init__.py"


def doc_problems(text: str, root: Path) -> list[str]:
    """Modules under `root` (the package folder) the doc does not name, entries naming nothing, and
    entries without a line. A folder entry names its package's `__init__`; a folder that is no package
    (Alembic's migrations) is named whole."""
    entries = doc_entries(text)
    out = [f"{name}: no line saying what it owns" for name, line in entries.items() if not line]
    out += [f"{name}: named in the doc, not in src/{root.name}" for name in entries if not (root / name).exists()]
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        folder = rel.rpartition("/")[0]
        named = rel in entries or (path.name == "__init__.py" and f"{folder}/" in entries)
        whole = any(e.endswith("/") and rel.startswith(e) and not (root / e / "__init__.py").exists() for e in entries)
        if not (named or whole or owns_nothing(path)):
            out.append(f"{rel}: not in the doc's module table")
    return out


def test_the_doc_names_every_module() -> None:
    """docs/architecture.md's module table names every module with one line of what it owns (a package
    `__init__` that only re-exports is exempt: its docstring says what the folder holds)."""
    problems = doc_problems(DOC.read_text(), SRC / PACKAGE)
    assert not problems, f"{DOC.relative_to(SRC.parent)}, `## Modules`:\n" + "\n".join(f"    {p}" for p in problems)


def test_undocumented_modules_are_caught(tmp_path: Path) -> None:
    """A control on a made-up package and doc."""
    root = tmp_path / PACKAGE
    for rel, text in {
        "__init__.py": '"""The package."""\n__version__ = "1"\n',
        "env.py": "",
        "run/__init__.py": "from .entry import train\n",
        "run/entry.py": "",
        "run/reexec.py": "",
        "serve/__init__.py": "def app(): ...\n",
        "serve/migrations/env.py": "",
        "serve/migrations/versions/0001.py": "",
        "trainer/__init__.py": "_pack = len\n",
        "trainer/loop.py": "",
        "trainer/step.py": "",
        "trainer/stages.py": "",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    doc = (
        "# A\n\n## Modules\n\n| module | holds |\n| --- | --- |\n"
        "| `env.py` | the environment |\n"
        "| `run/entry.py` | |\n"
        "| `serve/, serve/migrations/` | the service |\n"
        "| `trainer/loop.py, step.py` | the loop |\n"
        "| `plan/gone.py` | a module since removed |\n"
        "\n## Next\n\n| `trainer/stages.py` | outside the table |\n"
    )
    assert doc_entries(doc)["trainer/step.py"] == "the loop"
    assert doc_problems(doc, root) == [
        "run/entry.py: no line saying what it owns",
        "plan/gone.py: named in the doc, not in src/scaletune",
        "run/reexec.py: not in the doc's module table",
        "trainer/__init__.py: not in the doc's module table",
        "trainer/stages.py: not in the doc's module table",
    ]

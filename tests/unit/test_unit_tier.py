"""tests/unit starts no process (tests/README.md): no file there imports subprocess or
multiprocessing (torch's too) or calls `run_cli`, `run_torchrun`, `Popen`, `os.system`, `os.spawn*`,
`fork`, a `Process`, `Pool` or `ProcessPoolExecutor` (a spawn context's too), `get_context` or
`spawn`, read with `ast` (nothing imported). A test that must start one belongs to tests/e2e or
tests/distributed."""

from __future__ import annotations

import ast

from tests.helpers import REPO_ROOT

STARTERS = {
    "run_cli",
    "run_torchrun",
    "Popen",
    "system",
    "spawnl",
    "spawnv",
    "spawnlp",
    "spawnvp",
    "posix_spawn",
    "posix_spawnp",
    "fork",
    # multiprocessing, torch.multiprocessing and concurrent.futures, however reached
    # (`multiprocessing.Process`, `get_context("spawn").Process`, `mp.spawn`, a bare `Process`).
    "Process",
    "Pool",
    "ProcessPoolExecutor",
    "get_context",
    "spawn",
    "start_processes",
    "create_subprocess_exec",
    "create_subprocess_shell",
}
# Modules whose import alone says the file starts processes (`torch.multiprocessing` included).
STARTER_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing"}
# `psutil.Process(pid)` reads a running process; it starts none.
READERS = {"psutil"}


def _starter_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in STARTER_MODULES)


def process_starts(source: str) -> list[str]:
    """What in `source` imports subprocess or multiprocessing or calls a process starter, as `line: what`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _starter_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _starter_module(module) or any(_starter_module(f"{module}.{a.name}") for a in node.names):
                found.append(f"{node.lineno}: from {module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            reader = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in READERS
            if name in STARTERS and not reader:
                found.append(f"{node.lineno}: {name}(...)")
    return found


def test_the_check_sees_each_way_to_start_a_process():
    """The control: a file doing each thing the tier forbids is caught once per thing; a file that
    only names them in strings and docstrings, or reads a process with psutil, is not."""
    bad = (
        "import subprocess\nfrom subprocess import run\nimport os\n"
        "run_cli(['--help'])\nrun_torchrun('x.py')\nsubprocess.Popen(['true'])\nos.system('true')\n"
    )
    assert len(process_starts(bad)) == 6, process_starts(bad)
    # multiprocessing: the imports, a Process, a spawn context and the Process it makes, a pool
    spawned = (
        "import multiprocessing\nimport torch.multiprocessing as tmp\nfrom torch import multiprocessing\n"
        "from multiprocessing import Process\nmultiprocessing.Process(target=f).start()\n"
        "ctx = multiprocessing.get_context('spawn')\nctx.Process(target=f)\ntmp.spawn(f, nprocs=2)\n"
        "concurrent.futures.ProcessPoolExecutor(2)\nPool(2)\n"
    )
    assert len(process_starts(spawned)) == 10, process_starts(spawned)
    assert process_starts("from concurrent.futures import ThreadPoolExecutor\npsutil.Process(pid).status()\n") == []
    assert process_starts('"""run_cli, subprocess.Popen"""\nx = "import subprocess"\n') == []


def test_no_unit_test_starts_a_process():
    files = sorted((REPO_ROOT / "tests" / "unit").rglob("*.py"))
    assert len(files) > 20, files  # the walk found the tier
    offenders = {
        str(path.relative_to(REPO_ROOT)): starts for path in files if (starts := process_starts(path.read_text()))
    }
    assert not offenders, (
        f"tests/unit must start no process (move these to tests/e2e or tests/distributed): {offenders}"
    )

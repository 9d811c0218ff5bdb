"""tests/unit starts no process (tests/README.md): no file there imports subprocess or calls
`run_cli`, `run_torchrun`, `Popen`, `os.system` or `os.spawn*`, read with `ast` (nothing imported).
A test that must start one belongs to tests/e2e or tests/distributed."""

from __future__ import annotations

import ast

from tests.helpers import REPO_ROOT

STARTERS = {"run_cli", "run_torchrun", "Popen", "system", "spawnl", "spawnv", "spawnlp", "spawnvp", "fork"}


def process_starts(source: str) -> list[str]:
    """What in `source` imports subprocess or calls a process starter, as `line: what`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "subprocess"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "subprocess":
            found.append(f"{node.lineno}: from subprocess import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in STARTERS:
                found.append(f"{node.lineno}: {name}(...)")
    return found


def test_the_check_sees_each_way_to_start_a_process():
    """The control: a file doing each thing the tier forbids is caught once per thing; a file that
    only names them in strings and docstrings is not."""
    bad = (
        "import subprocess\nfrom subprocess import run\nimport os\n"
        "run_cli(['--help'])\nrun_torchrun('x.py')\nsubprocess.Popen(['true'])\nos.system('true')\n"
    )
    assert len(process_starts(bad)) == 6, process_starts(bad)
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

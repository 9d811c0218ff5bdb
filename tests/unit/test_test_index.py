"""tests/README.md's module -> test index stays true: every module under src/scaletune is listed
with at least one test file, every listed module exists, every listed test file exists. The
modules are found by scripts/test_index.py (read with `ast`, nothing imported)."""

from __future__ import annotations

import importlib.util
import re

from tests.helpers import REPO_ROOT

ROW = re.compile(r"^\|\s*`(scaletune(?:\.\w+)*)`\s*\|(.*)\|\s*$")
REFRESH = "run `python scripts/test_index.py` for a fresh table and merge it into tests/README.md"


def listed() -> dict[str, list[str]]:
    """module -> test paths, from the index table of tests/README.md."""
    out: dict[str, list[str]] = {}
    for line in (REPO_ROOT / "tests" / "README.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in out, f"tests/README.md lists {m.group(1)} twice"
            out[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    return out


def source_modules() -> set[str]:
    spec = importlib.util.spec_from_file_location("test_index", REPO_ROOT / "scripts" / "test_index.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return set(script.modules())


def test_every_module_is_listed_and_every_listed_module_exists():
    index, modules = listed(), source_modules()
    assert len(modules) > 50, sorted(modules)  # the walk found the tree
    missing = sorted(modules - set(index))
    assert not missing, f"modules missing from tests/README.md's index: {missing}; {REFRESH}"
    gone = sorted(set(index) - modules)
    assert not gone, f"tests/README.md lists modules that no longer exist: {gone}; {REFRESH}"


def test_every_module_has_tests_and_every_listed_test_exists():
    index = listed()
    untested = sorted(m for m, tests in index.items() if not tests)
    assert not untested, f"modules with no test named in tests/README.md: {untested} (TODO is not a test file)"
    absent = sorted({(m, t) for m, tests in index.items() for t in tests if not (REPO_ROOT / t).is_file()})
    assert not absent, f"tests/README.md names test files that do not exist (module, path): {absent}"

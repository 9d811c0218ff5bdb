"""Shared test fixtures: the real data in ../shared/data, tiny models, the slow tier. Constants and
builders are in tests/helpers.py (import them from there, never from this file)."""

from __future__ import annotations

import os
import resource
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import ALPACA_5000, SHARED_DATA, SMALL_TOKENIZER

# Tests never reach a hub; DeepSpeed runs on its CPU accelerator where no CUDA GPU is visible (the
# GPU tier needs it on CUDA).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cores_per_worker() -> int | None:
    """This pytest-xdist worker's share of the cores (None outside xdist or with one worker): the
    cores this process may use (affinity, cgroup quota: scaletune's own `cpu_budget`) split between
    the workers as between a node's ranks.

    `scripts/test.sh` runs one worker more than the cores, so tests' processes always share the machine;
    a process that sized its OpenMP pool from the whole machine (torch's default, and scaletune's
    own `CpuBudget` for one rank) runs threads that spin against the other worker's. Measured on
    2 cores: two tiny single-process runs at once took 21.7 s and 21 CPU-s each with 2 threads,
    16-17 s and 15-16.5 CPU-s each with 1 (16.4 s alone, no faster with 2)."""
    from scaletune.env import cpu_budget

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    return cpu_budget(workers, environ={}).threads if workers > 1 else None


# Every process a test starts inherits it (a test about sizing from the cores removes it: `run_cli`
# with `cores`, the plain-command cases of tests/distributed/test_edge_matrix.py).
if (_share := _cores_per_worker()) is not None and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)


# The units `scripts/test.sh` hands to its pytest-xdist workers: a test module by default, so a
# module's fixtures (a server, a browser, a Postgres) start once; the modules whose tests share
# package-scoped runs (`run_once`, `finished_runs`) as one unit, so each of those runs trains once;
# the system tier as one, since its SLURM cluster is one per session.
SHARED_RUN_GROUPS = {
    "tests/distributed/test_parity.py": "distributed-runs",
    "tests/distributed/test_resume.py": "distributed-runs",
    "tests/distributed/test_mesh_parity.py": "distributed-runs",  # its references are test_parity's
    "tests/security/test_bad_input.py": "security-runs",
    "tests/security/test_hostile_checkpoints.py": "security-runs",
    "tests/security/test_run_directory.py": "security-runs",
    "tests/security/test_strangers_files.py": "security-runs",
}


def worker_group(nodeid: str) -> str:
    """The xdist unit of the test `nodeid` (its path relative to the repository, then `::`)."""
    path = nodeid.split("::", 1)[0]
    return "system" if path.startswith("tests/system/") else SHARED_RUN_GROUPS.get(path, path)


def pytest_xdist_auto_num_workers(config) -> int:
    """How many workers `-n auto` (pyproject's addopts: plain `pytest` too) starts: one more than the
    cores this process may use (at least 2 of them), at most 4 (each worker imports torch and
    transformers, ~12 CPU-s, and its zygote as much again). Much of a test's time is a service
    answering, a browser rendering or SLURM scheduling, not arithmetic: on 2 cores, one worker a core
    kept them 93 % busy and CI's pytest took 1,760 s (at 4c51e8c); three workers, 99 % and 1,665 s
    (at 11794c3)."""
    from scaletune.env import cpu_budget

    return min(4, max(2, cpu_budget(1, environ={}).threads) + 1)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # plain pytest without the dev extra: no workers, no scheduler
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class _ByWorkerGroup(LoadScopeScheduling):
        """xdist's scope scheduling with :func:`worker_group` as the scope. (`--dist loadgroup`
        cannot do this under pytest 9.2: xdist 3.8 renames items through `Item._nodeid`, which
        pytest 9.2 no longer reads.)"""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        # Units are handed out in collection order, which pytest_collection_modifyitems makes the
        # longest first (xdist's own reorder puts the units of most tests first: the unit tier's).
        config.option.loadscopereorder = False
        return _ByWorkerGroup(config, log)


# What each unit took in CI (tests/assets/test-costs.json, scripts/test_costs.py): the units are
# collected longest first, so that the last ones handed out are short and the workers end together
# (the longest processing time first rule); a unit the table does not know counts as a minute.
UNKNOWN_UNIT_SECONDS = 60.0


def _by_cost(items: list) -> None:
    import json

    table = json.loads((Path(__file__).parent / "assets" / "test-costs.json").read_text())["seconds"]
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(worker_group(item.nodeid), i)
    items.sort(
        key=lambda item: (
            -table.get(worker_group(item.nodeid), UNKNOWN_UNIT_SECONDS),
            first_seen[worker_group(item.nodeid)],
        )
    )


def pytest_collection_finish(session) -> None:
    """Record the environment the tests start from (tests/helpers.py SESSION_ENVIRON): after every
    module's import-time settings, before any test's monkeypatching."""
    from tests import helpers

    helpers.SESSION_ENVIRON.update(os.environ)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `slow` measure rather than prove (benchmarks, load) or wait for CI time:
    they run with SCALETUNE_SLOW_TESTS=1 (`bash scripts/test.sh --slow`), not in the default run CI makes."""
    _by_cost(items)
    if os.environ.get("SCALETUNE_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow tier: set SCALETUNE_SLOW_TESTS=1 (bash scripts/test.sh --slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Per-test durations (setup + call + teardown, seconds), written where SCALETUNE_TEST_DURATIONS names
# (scripts/test.sh: test-durations.tsv) and summed per tier at the end of the run, so CI's log shows
# where the time went and tests/README.md's budgets can be checked against it.
_DURATIONS: dict[str, float] = {}
# And the CPU seconds each test cost: the test worker's own and its finished child processes'
# (every process a test started and waited for, forks of the CLI zygote included: the CLI, torchrun and its ranks, a service and the
# jobs it ran, Chromium, Postgres), so the tiers' CPU is visible, not only what Python processes log.
_CPU: dict[str, list[float]] = {}
_CPU_MARK = pytest.StashKey[tuple[float, float]]()
_CPU_AT_START: list[int] = []


def _process_cpu() -> tuple[float, float]:
    """(this process's CPU seconds, its waited-for descendants' CPU seconds), user + system: the
    forks of its CLI zygote and the processes delegated to it are counted as its descendants."""
    from tests import helpers
    from tests.forked_cli import FORKED_CPU

    me, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    delegated = helpers._zygote().delegated_cpu() if helpers._zygote.cache_info().currsize else 0.0
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime + FORKED_CPU[0] + delegated


# The tiers whose tests run the service in the test worker (tests/serve/serve_helpers.py Server and
# their own JobService): its jobs, config checks and tasks are the worker's own children.
SERVICE_TIERS = ("serve", "security", "system")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    if _tier(item.nodeid) in SERVICE_TIERS:
        from tests import helpers

        helpers.worker_children_through_zygote()
    item.stash[_CPU_MARK] = _process_cpu()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU spent since the last (a user property, which
    pytest-xdist sends back with the report)."""
    outcome = yield
    now = _process_cpu()
    before = item.stash.get(_CPU_MARK, now)
    item.stash[_CPU_MARK] = now
    outcome.get_result().user_properties.append(("cpu", (now[0] - before[0], now[1] - before[1])))


def _machine_cpu() -> list[int]:
    """The machine's CPU time since boot as (busy, idle) jiffies, from /proc/stat's first line
    (idle and iowait count as idle); empty where there is no /proc/stat."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return []
    idle = fields[3] + fields[4]
    return [sum(fields) - idle, idle]


_CPU_AT_START[:] = _machine_cpu()  # this conftest loads at collection, after pytest_sessionstart


def pytest_runtest_logreport(report) -> None:
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    cpu = _CPU.setdefault(report.nodeid, [0.0, 0.0])
    for name, value in report.user_properties:
        if name == "cpu":
            cpu[0] += value[0]
            cpu[1] += value[1]


def _tier(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    if parts[0] != "tests" or len(parts) < 3:
        return "other"
    return "fast (cli usage)" if parts[1:] == ["e2e", "test_cli_usage.py"] else parts[1]


def pytest_terminal_summary(terminalreporter) -> None:
    if not _DURATIONS:
        return
    ranked = sorted(_DURATIONS.items(), key=lambda kv: -kv[1])
    path = os.environ.get("SCALETUNE_TEST_DURATIONS")
    cpu = {n: _CPU.get(n, [0.0, 0.0]) for n, _ in ranked}
    if path:  # seconds, the test, the worker's CPU-s, its child processes' CPU-s
        Path(path).write_text("".join(f"{d:.2f}\t{n}\t{cpu[n][0]:.2f}\t{cpu[n][1]:.2f}\n" for n, d in ranked))
    tiers: dict[str, list[tuple[float, float, float]]] = {}
    for nodeid, seconds in ranked:
        tiers.setdefault(_tier(nodeid), []).append((seconds, *cpu[nodeid]))
    write = terminalreporter.write_line
    write("")
    write(f"test time and CPU by tier ({len(ranked)} tests{'; all of them in ' + path if path else ''}):")
    for tier, rows in sorted(tiers.items(), key=lambda kv: -sum(r[0] for r in kv[1])):
        own, kids = sum(r[1] for r in rows), sum(r[2] for r in rows)
        write(
            f"  {tier:<16} {sum(r[0] for r in rows):8.1f} s  {len(rows):5d} tests  "
            f"CPU {own + kids:8.0f} s ({own:.0f} in the test workers, {kids:.0f} in their child processes)"
        )
    write("the ten slowest tests:")
    for nodeid, seconds in ranked[:10]:
        write(f"  {seconds:8.1f} s  {nodeid}")
    now = _machine_cpu()
    if _CPU_AT_START and now and "PYTEST_XDIST_WORKER" not in os.environ:
        # Whether more test workers would help: the cores' share the run kept busy (everything on
        # the machine, the tests' processes and services included).
        busy, idle = (b - a for a, b in zip(_CPU_AT_START, now))
        write(f"the machine's CPUs were busy {100 * busy / max(1, busy + idle):.0f} % of the run")
    _process_summary(write)


def _process_kind(line: dict) -> str:
    """What a logged process was (tests/instrument/sitecustomize.py): a rank of a launcher, a
    torchrun agent (one that a plain `scaletune train` re-executed into carries that parent's
    CPU too), a scaletune verb, or the program's name."""
    argv = line["argv"]
    program = argv[0] if argv else "?"
    if program == "distributed/run.py":
        return "torchrun agent"
    if program == "scaletune/__main__.py" and len(argv) > 1:
        return f"scaletune {argv[1]}" + (" (a rank)" if line.get("rank") is not None else "")
    return program + (" (a rank)" if line.get("rank") is not None else "")


def _process_summary(write) -> None:
    """The processes the tests started and their CPU (SCALETUNE_PROCESS_LOG, when set), by kind and
    by test: where the suite's CPU goes besides the test workers themselves."""
    import json

    path = os.environ.get("SCALETUNE_PROCESS_LOG")
    if not path or not Path(path).is_file():
        return
    lines = []
    for text in Path(path).read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            continue  # a line cut short by a full disk or a killed writer
    kinds: dict[str, list[float]] = {}
    tests: dict[str, list[float]] = {}
    for line in lines:
        kinds.setdefault(_process_kind(line), []).append(line["cpu"])
        tests.setdefault(line["test"].split("::", 1)[0] or "(outside a test)", []).append(line["cpu"])
    total = sum(sum(v) for v in kinds.values())
    write(f"processes the tests started: {len(lines)}, {total:.0f} CPU-s (each line of {path}):")
    for kind, cpus in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:12]:
        write(f"  {kind:<28} {len(cpus):5d} processes {sum(cpus):8.0f} CPU-s  ({sum(cpus) / len(cpus):5.1f} each)")
    started = [line.get("started", "fresh") for line in lines]
    refused: dict[str, int] = {}
    for how in started:
        if how.startswith("refused: "):
            refused[how[len("refused: ") :]] = refused.get(how[len("refused: ") :], 0) + 1
    write(
        f"  forks of a test worker's zygote (tests/forked_cli.py): {started.count('forked')} CLI calls, "
        f"{started.count('delegated')} processes delegated to it; {sum(refused.values())} asked and started fresh:"
    )
    for why, count in sorted(refused.items(), key=lambda kv: -kv[1])[:5]:
        write(f"  {count:5d} {why[:150]}")
    write("  the ten test modules whose processes took the most CPU:")
    for module, cpus in sorted(tests.items(), key=lambda kv: -sum(kv[1]))[:10]:
        write(f"  {sum(cpus):8.0f} CPU-s {len(cpus):5d} processes  {module}")


@pytest.fixture(autouse=True)
def _tf32_restored() -> Iterator[None]:
    """Every test leaves TF32 as it found it. A bf16 run's setup on a GPU turns it on for the
    process (`torch.set_float32_matmul_precision("high")`, cuDNN's flag); a test that trains
    in-process (the GPU tier's QLoRA test) would otherwise leave later fp32 comparisons and the
    TF32 getter test in tests/unit/test_gpu_paths.py running under it."""

    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    if torch.get_float32_matmul_precision() != matmul:
        torch.set_float32_matmul_precision(matmul)
    if torch.backends.cudnn.allow_tf32 != cudnn:
        torch.backends.cudnn.allow_tf32 = cudnn


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not ALPACA_5000.is_file():
        pytest.fail(f"the reference data is missing: {ALPACA_5000} (../shared/data beside the clone)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def module_tmp_path(request, tmp_path_factory) -> Iterator[Path]:
    """A folder for the runs one module's tests share, removed when the module is done.

    The suite trains a few hundred runs whose checkpoints (about 150 MB each) would fill the disk
    if each stayed until the session ends; `tmp_path` is removed after each passing test
    (`tmp_path_retention_policy = "failed"` in pyproject.toml) and this one after its module."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The `olmo2-tiny` preset with the tests' tokenizer (tests/helpers.py SMALL_TOKENIZER: OLMo-2's,
    cut to the 27,110 tokens the project's data uses), randomly initialised and saved once per test
    session: 3.7M parameters, where OLMo-2's whole vocabulary makes it 13.2M (98.5 % embeddings)."""
    from scaletune.models import init_model

    out = tmp_path_factory.mktemp("models") / "olmo2-tiny"
    return init_model("olmo2-tiny", out, seed=0, tokenizer_file=SMALL_TOKENIZER)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """The `llama-tiny` preset with the tests' tokenizer, as :func:`tiny_model_dir`."""
    from scaletune.models import init_model

    out = tmp_path_factory.mktemp("models") / "llama-tiny"
    return init_model("llama-tiny", out, seed=0, tokenizer_file=SMALL_TOKENIZER)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    """The `idefics3-tiny` preset (a vision-language model, its processor beside it) with the tests'
    tokenizer, as :func:`tiny_model_dir`: 1.8M parameters."""
    from scaletune.models import init_model

    out = tmp_path_factory.mktemp("models") / "idefics3-tiny"
    return init_model("idefics3-tiny", out, seed=0, tokenizer_file=SMALL_TOKENIZER)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> Path:
    """The `llava-tiny` preset (LLaVA-1.5's architecture, its processor beside it) with the tests'
    tokenizer, as :func:`tiny_model_dir`."""
    from scaletune.models import init_model

    out = tmp_path_factory.mktemp("models") / "llava-tiny"
    return init_model("llava-tiny", out, seed=0, tokenizer_file=SMALL_TOKENIZER)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    """The `gemma3-tiny` preset (Gemma 3's architecture, its processor beside it) with the tests'
    tokenizer, as :func:`tiny_model_dir`."""
    from scaletune.models import init_model

    out = tmp_path_factory.mktemp("models") / "gemma3-tiny"
    return init_model("gemma3-tiny", out, seed=0, tokenizer_file=SMALL_TOKENIZER)


@pytest.fixture(scope="session")
def olmo2_vocab_model_dir(tmp_path_factory) -> Path:
    """The `olmo2-tiny` preset exactly as `scaletune init-model olmo2-tiny` builds it (the bundled
    OLMo-2 tokenizer, 100,352 rows), for the tests about that default."""
    from scaletune.models import init_model

    return init_model("olmo2-tiny", tmp_path_factory.mktemp("models") / "olmo2-vocab", seed=0)

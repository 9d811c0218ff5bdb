"""The command line as a person meets it, in a subprocess: `--help` laid out for the terminal,
usage mistakes answered with exit 2 and a sentence (moved here from tests/unit, which starts no
process)."""

from __future__ import annotations

from tests.helpers import modules_after, run_cli


def test_help_imports_no_torch():
    """Startup is a product cost: `--help` is typer's work alone (`import torch` alone is seconds)."""
    for args in (["--help"], ["train", "--help"]):
        heavy = modules_after(args) & {"torch", "transformers", "deepspeed", "datasets", "fastapi"}
        assert not heavy, f"scaletune {' '.join(args)} imported {sorted(heavy)}"


def test_help_rewraps_docstrings_to_the_terminal():
    """With a terminal wide enough for every summary, each command is one row: a docstring's hard
    line breaks must not survive into the panel (they did before markdown mode)."""
    proc = run_cli(["--help"], env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"})
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│ ")]
    commands = rows[rows.index(next(r for r in rows if r.startswith("│ train"))) :]
    continuation = [r for r in commands if r[2] == " " and r.strip("│ ")]
    assert not continuation, "\n".join(continuation)
    for verb in ("chat", "generate", "eval"):
        assert any(r.startswith(f"│ {verb} ") for r in commands)


def test_init_model_lists_the_real_preset_and_asks_for_an_output_for_tiny_ones(tmp_path):
    proc = run_cli(["init-model", "no-such-preset", "-o", str(tmp_path / "m")])
    assert proc.returncode == 2 and "smollm2-135m-instruct" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["init-model", "olmo2-tiny"])
    assert proc.returncode == 2 and "-o DIR" in proc.stderr


def test_version_and_the_doctor_rows_for_it_and_cpu_threads():
    """`scaletune --version` names the package version and, from a checkout, its commit (control:
    git's own answer); `doctor --json` reports the same, and warns when OMP_NUM_THREADS asks for
    more threads than this process has cores (its affinity mask)."""
    import json
    import os
    import subprocess

    import scaletune
    from tests.helpers import REPO_ROOT

    proc = run_cli(["--version"])
    version = proc.stdout.strip()
    assert proc.returncode == 0 and version.startswith(f"scaletune {scaletune.__version__}"), proc
    if (REPO_ROOT / ".git").exists():
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        assert f"(git {head.stdout.strip()}" in proc.stdout, proc.stdout
    cores = len(os.sched_getaffinity(0))
    proc = run_cli(["doctor", "--json"], env={"OMP_NUM_THREADS": str(4 * cores)})
    answer = json.loads(proc.stdout)
    assert answer["report"]["scaletune"] == version.removeprefix("scaletune ")
    threads = {c["name"]: c for c in answer["checks"]}["CPU threads"]
    assert threads["status"] == "WARN", threads
    assert f"1 rank(s) x OMP_NUM_THREADS {4 * cores} = {4 * cores} threads on " in threads["message"], threads


def test_every_verb_shows_an_example_line():
    """Each verb a person starts a job or reads a result with shows one example line in its
    `--help` (issue 40): the help text typer renders, read from the command tree in-process."""
    import typer

    from scaletune.cli import app

    root = typer.main.get_command(app)
    verbs = ["train", "init-model", "export", "plan", "doctor", "chat", "generate", "eval", "launch", "slurm",
             "modal", "serve"]  # fmt: skip
    missing = [v for v in verbs if "Example: `scaletune " not in (root.commands[v].help or "")]
    for group, verb in (("config", "new"), ("remote", "submit")):
        if "Example: `scaletune " not in (root.commands[group].commands[verb].help or ""):
            missing.append(f"{group} {verb}")
    assert not missing, missing
    shown = run_cli(["export", "--help"], env={"COLUMNS": "200"}).stdout
    assert "Example: scaletune export runs/quickstart -o my-model --merge-lora" in shown, shown

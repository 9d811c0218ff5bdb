"""Nothing from a config, an override or a path runs when a generated sbatch script, launch script
or Modal app runs: the generated files are executed here with stub cluster tools (srun, scontrol,
the interpreter; a stub `modal` module) on hostile values, and the marker files their payloads
would create never appear, while every value arrives intact as one argument or literal."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import run_cli

# Shell and Python metacharacters a careless or hostile value may hold (no control characters:
# those are refused with exit 2, see test_control_characters_are_refused).
HOSTILE = "x'; touch {m}; echo '\" $(touch {m}) `touch {m}` \\\"\"\" ; import os; os.system('touch {m}') #"


def stub(bin_dir: Path, name: str, log: Path) -> None:
    """An executable `name` that records its argv, one JSON list per call, and does nothing else."""
    path = bin_dir / name
    path.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n"
        + ("print('node-a')\n" if name == "scontrol" else "")
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def config_file(tmp_path: Path, marker: Path) -> Path:
    hostile = HOSTILE.format(m=marker)
    d = tmp_path / f"cfg dir $(touch {marker.name}) `touch {marker.name}`"
    d.mkdir()
    path = d / "c.yaml"
    path.write_text(
        json.dumps(
            {
                "output_dir": f"runs/out{hostile}",
                "model": {"name_or_path": "m"},
                "data": {"dummy": {"num_samples": 8}, "max_seq_length": 16},
                "training": {"global_batch_size": 8, "micro_batch_size": 1},
                "distributed": {"env": {"NCCL_DEBUG": hostile}},
            }
        )
    )
    return path


@pytest.fixture
def world(tmp_path):
    marker = tmp_path / "PWNED"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    for name in ("srun", "scontrol", "sbatch"):
        stub(bin_dir, name, log)
    return marker, bin_dir, log, config_file(tmp_path, marker)


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_sbatch_script_runs_nothing_injected(world, tmp_path):
    marker, bin_dir, log, config = world
    hostile = HOSTILE.format(m=marker)
    script = tmp_path / "job.sbatch"
    override = f"training.learning_rate_note={hostile}"  # an unknown key: refused, see below
    proc = run_cli(
        ["slurm", str(config), "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "1", "-o", str(script)],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert hostile not in [line for line in text.splitlines() if line.startswith("#")]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NUM_NODES": "1"}  # fmt: skip
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not marker.exists(), "a value ran as a command"
    (srun,) = [c for c in calls(log) if c[0] == "srun"]
    assert str(config) in srun  # the path, with its `$(...)`, as one argument
    exported = subprocess.run(["bash", "-c", f"set -a; source <(grep '^export ' {script}); printf %s \"$NCCL_DEBUG\""],
                              capture_output=True, text=True, env=env)  # fmt: skip
    assert exported.stdout == hostile and not marker.exists()
    bad = run_cli(["slurm", str(config), "--gpus-per-node", "0", "--procs-per-node", "1", override], cwd=tmp_path)
    assert bad.returncode == 2 and "unknown key" in bad.stderr


def test_launch_script_runs_nothing_injected(world, tmp_path):
    marker, bin_dir, log, config = world
    python = bin_dir / "python"
    stub(bin_dir, "python", log)
    script = tmp_path / "node0.sh"
    proc = run_cli(["launch", str(config), "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "1",
                    "--python", str(python), "--script", str(script)], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    (call,) = calls(log)
    assert call[0] == "python" and str(config) in call
    assert "-m" in call and "scaletune" in call


def test_modal_app_runs_nothing_injected(world, tmp_path):
    """The app imported with a stub `modal` package (no Modal account is reachable here): nothing
    injected runs at import, and the embedded config equals the hostile values byte for byte."""
    marker, _, _, config = world
    app = tmp_path / "app.py"
    proc = run_cli(["modal", str(config), "--gpu-count", "1", "--gpu-type", "H100", "-o", str(app)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "modal.py").write_text(
        textwrap.dedent(
            """
            class _Chain:
                def __init__(self, *a, **k): pass
                def __getattr__(self, name): return lambda *a, **k: self
                def __call__(self, *a, **k): return self
            class Image(_Chain):
                @staticmethod
                def debian_slim(*a, **k): return _Chain()
            class Volume:
                @staticmethod
                def from_name(*a, **k): return _Chain()
            class Secret:
                @staticmethod
                def from_name(*a, **k): return _Chain()
            class App(_Chain):
                def function(self, *a, **k): return lambda f: f
                def local_entrypoint(self, *a, **k): return lambda f: f
            """
        )
    )
    code = f"import runpy, json; g = runpy.run_path({str(app)!r}); print(json.dumps(g['CONFIG_YAML']))"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(stubs)}
    )
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    import yaml

    embedded = yaml.safe_load(json.loads(r.stdout))
    assert embedded["distributed"]["env"]["NCCL_DEBUG"] == HOSTILE.format(m=marker)


@pytest.mark.parametrize("verb", ["slurm", "launch", "modal", "train"])
def test_control_characters_are_refused(world, tmp_path, verb):
    """A newline in an override (or a config value) would start a new line of shell in any
    comment or log it reached: refused with exit 2 before anything is written."""
    marker, _, _, config = world
    args = {"slurm": ["--gpus-per-node", "0", "--procs-per-node", "1", "-o", str(tmp_path / "j.sbatch")],
            "launch": ["--script", str(tmp_path / "l.sh")], "modal": ["-o", str(tmp_path / "a.py")], "train": []}[verb]  # fmt: skip
    proc = run_cli([verb, str(config), *args, f"seed=1\ntouch {marker}"], cwd=tmp_path)
    assert proc.returncode == 2 and "control character" in proc.stderr and "Traceback" not in proc.stderr
    assert not any((tmp_path / n).exists() for n in ("j.sbatch", "l.sh", "a.py")) and not marker.exists()

"""The launch builders' output run by the real programs (moved from tests/unit, which starts no
process): bash runs the launch scripts with hostile values and parses the sbatch and launch scripts,
a fake sbatch answers `submit`, a fresh interpreter imports the builders without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scaletune.errors import UserError
from scaletune.launch.commands import LaunchOptions, build_launch
from scaletune.launch.shell import shell_join
from scaletune.launch.slurm import SlurmOptions, render_sbatch, submit

HOSTILE = ["a b", "it's", 'say "hi"', "$(touch /tmp/pwned)", "`id`", "x;rm -rf /", "$HOME", "*"]


@pytest.mark.parametrize("value", HOSTILE)
def test_values_stay_inert_in_the_shell(value, tmp_path):
    """Config path, overrides and env values with spaces, quotes and $(...) reach the program verbatim."""
    cmd = build_launch(
        LaunchOptions(
            config=value,
            overrides=(f"output_dir={value}",),
            gpus_per_node=1,
            python="printf",
            config_env={"MY_VAR": value},
        )
    )
    script = cmd.script(workdir=str(tmp_path / value.replace("/", "_")))
    (tmp_path / value.replace("/", "_")).mkdir()
    # Replace the launcher by printf so the script prints its argv (one per line) and MY_VAR.
    line = shell_join(["printf", "%s\\n", *cmd.argv[1:]])
    body = script.replace(cmd.shell_command(), line + '\nprintf "%s\\n" "$MY_VAR"')
    out = subprocess.run(["bash", "-c", body], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = out.stdout.split("\n")
    assert got[-2] == value  # MY_VAR
    assert value in got and f"output_dir={value}" in got
    assert not list(tmp_path.glob("pwned")) and not (tmp_path.parent / "pwned").exists()


def test_launch_script_with_a_secret_parses_in_bash():
    """The script the secret-hiding test reads (tests/unit/test_launch_commands.py) is valid bash."""
    cmd = build_launch(
        LaunchOptions(
            config="c.yaml",
            nodes=2,
            node_rank=1,
            master_addr="10.0.0.1",
            gpus_per_node=2,
            config_env={"WANDB_API_KEY": "k-123", "X": "1"},
        )
    )
    r = subprocess.run(["bash", "-n"], input=cmd.script(workdir="/work dir"), text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


def test_sbatch_script_with_hostile_values_parses_in_bash(tmp_path):
    """The sbatch script whose quoting tests/unit/test_launch_slurm.py reads is valid bash."""
    evil = "$(touch pwned) `id` it's"
    text = render_sbatch(
        SlurmOptions(
            config=evil,
            nodes=2,
            gpus_per_node=8,
            overrides=(f"output_dir={evil}",),
            config_env={"V": evil},
            python=evil,
            workdir=str(tmp_path),
        )
    )
    r = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


def test_deepspeed_script_writes_its_hostfile(tmp_path):
    cmd = build_launch(
        LaunchOptions(
            config="c.yaml",
            nodes=2,
            node_rank=0,
            gpus_per_node=0,
            procs_per_node=3,
            master_addr="10.0.0.1",
            launcher="deepspeed",
            python="echo",
        )
    )
    script = cmd.script(workdir=str(tmp_path))
    out = subprocess.run(["bash", "-c", script + 'cat "$SCALETUNE_FILE_0"\n'], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("node-0 slots=3\nnode-1 slots=3\n")
    assert "--hostfile /tmp/" in out.stdout


def test_builders_do_not_import_torch():
    code = (
        "import sys; import scaletune.launch, scaletune.launch.slurm, scaletune.launch.modal_app, "
        "scaletune.launch.configs, scaletune.launch.presets; "
        "assert 'torch' not in sys.modules, 'launch/ imported torch'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_submit_parses_the_job_id(tmp_path):
    fake = tmp_path / "sbatch"
    fake.write_text('#!/bin/sh\n[ "$1" = --parsable ] && echo "4242;cluster"\n')
    fake.chmod(0o755)
    assert submit("job.sbatch", sbatch=str(fake)) == "4242"
    bad = tmp_path / "sbatch-bad"
    bad.write_text("#!/bin/sh\necho 'sbatch: error: Invalid partition name specified' >&2; exit 1\n")
    bad.chmod(0o755)
    with pytest.raises(UserError, match="Invalid partition"):
        submit("job.sbatch", sbatch=str(bad))
    with pytest.raises(UserError, match="not found"):
        submit("job.sbatch", sbatch=str(tmp_path / "missing"))

"""The sbatch script builder (scaletune.launch.slurm): exact lines, quoting, validation (bash parsing
the script and a fake sbatch: tests/e2e/test_launch_scripts.py)."""

from __future__ import annotations

import pytest

from scaletune.errors import UserError
from scaletune.launch.slurm import SlurmOptions, render_sbatch, sbatch_directives, time_problems

PY = "/venv/bin/python"


def opts(**kw) -> SlurmOptions:
    base = dict(config="cfg.yaml", nodes=2, gpus_per_node=8, python=PY)
    base.update(kw)
    return SlurmOptions(**base)


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_gpu_job_directives_are_literal_and_quoted():
    text = render_sbatch(
        opts(
            time="12:00:00",
            partition="gpu",
            account="proj-1",
            job_name="my run",
            mem_per_gpu="80G",
            workdir="/home/u/my proj",
        )
    )
    assert sbatch_lines(text) == [
        '#SBATCH --job-name="my run"',
        '#SBATCH --nodes="2"',
        '#SBATCH --ntasks-per-node="1"',
        '#SBATCH --gpus-per-node="8"',
        '#SBATCH --cpus-per-task="8"',
        '#SBATCH --mem-per-gpu="80G"',
        '#SBATCH --time="12:00:00"',
        '#SBATCH --partition="gpu"',
        '#SBATCH --account="proj-1"',
        '#SBATCH --chdir="/home/u/my proj"',
        '#SBATCH --output="%x-%j.out"',
    ]
    for line in sbatch_lines(text):
        assert "$" not in line  # sbatch never expands variables in directives


def test_directives_come_before_the_first_command():
    text = render_sbatch(opts())
    lines = text.splitlines()
    first_cmd = next(i for i, l in enumerate(lines) if l and not l.startswith("#"))
    assert all(i < first_cmd for i, l in enumerate(lines) if l.startswith("#SBATCH"))


def test_master_port_and_srun_torchrun_line():
    text = render_sbatch(opts(overrides=("training.max_steps=5",), max_restarts=2))
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1 || true)"' in text
    assert 's.bind(("", 0))' in text and "export MASTER_ADDR MASTER_PORT" in text
    assert text.endswith(
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=8 --kill-on-bad-exit=1 \\\n'
        '    "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_JOB_NUM_NODES" '
        '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "scaletune-$SLURM_JOB_ID" '
        "--nproc-per-node 8 --max-restarts 2 \\\n"
        "    -m scaletune train cfg.yaml training.max_steps=5\n"
    )
    assert f"PYTHON={PY}\n" in text


def test_cpu_nodes():
    text = render_sbatch(opts(nodes=1, gpus_per_node=0, procs_per_node=2, cpus_per_task=4, mem="8G"))
    assert not any("gpus-per-node" in l for l in sbatch_lines(text))
    assert '#SBATCH --cpus-per-task="4"' in text and '#SBATCH --mem="8G"' in text
    assert "--nproc-per-node 2 " in text
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"' in text


def test_env_presets_and_secrets():
    text = render_sbatch(
        opts(config_env={"HF_TOKEN": "hf_abc", "NCCL_SOCKET_IFNAME": "ib0"}, env_presets=("debug", "no-ib"))
    )
    assert "hf_abc" not in text
    assert (
        "export NCCL_SOCKET_IFNAME=ib0\n" in text
        and "export NCCL_DEBUG=INFO\n" in text
        and "export NCCL_IB_DISABLE=1\n" in text
    )
    assert "--export=ALL" in text and '[ -n "${HF_TOKEN+x}" ]' in text


def test_hostile_values_are_quoted(tmp_path):
    evil = "$(touch pwned) `id` it's"
    text = render_sbatch(
        opts(config=evil, overrides=(f"output_dir={evil}",), config_env={"V": evil}, python=evil, workdir=str(tmp_path))
    )
    assert "export V='$(touch pwned) `id` it'\"'\"'s'" in text
    assert "PYTHON='$(touch pwned) `id` it'\"'\"'s'" in text
    assert "train '$(touch pwned) `id` it'\"'\"'s' 'output_dir=$(touch pwned) `id` it'\"'\"'s'" in text


def test_sbatch_directives_reject_quotes_and_newlines():
    for bad in ('a"b', "a\nb", "a\\b", ""):
        with pytest.raises(UserError, match="--job-name"):
            render_sbatch(opts(job_name=bad))


@pytest.mark.parametrize(
    "value", ["30", "90", "1:30", "12:00:00", "2-0", "2-12", "2-12:30", "1-00:00:00", "UNLIMITED", "infinite"]
)
def test_valid_time_limits(value):
    assert time_problems(value) == []


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        "1:2:3:4",
        "12:60:00",
        "1:99:00",
        "0:00:70",
        "2-24",
        "-1",
        "0",
        "00:00:00",
        "1h",
        "1:00:00 "[:-1] + "x",
        "",
    ],
)
def test_invalid_time_limits(value):
    assert time_problems(value)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(gpus_per_node=0), "needs --procs-per-node"),
        (dict(gpus_per_node=None), "--gpus-per-node is required"),
        (dict(nodes=0), "--nodes must be 1 or more"),
        (dict(time="25:61:00"), "--time"),
        (dict(env_presets=("turbo",)), "unknown env preset"),
        (dict(mem_per_gpu="lots"), "not a SLURM memory size"),
        (dict(gpus_per_node=0, procs_per_node=2, mem_per_gpu="8G"), "--mem-per-gpu needs GPUs"),
        (dict(cpus_per_task=0), "--cpus-per-task"),
        (dict(max_restarts=-1), "--max-restarts"),
    ],
)
def test_bad_input(kw, message):
    with pytest.raises(UserError) as exc:
        render_sbatch(opts(**kw))
    assert message in exc.value.format()


def test_extra_sbatch_lines():
    d = sbatch_directives(opts(extra_sbatch=("--exclusive", "--constraint=a100")))
    assert ("exclusive", "") in d and ("constraint", "a100") in d

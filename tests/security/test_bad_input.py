"""Careless input ends with exit 2 and one message naming every problem (file, line, key), never
a traceback, and nothing written: each case below crashed with a traceback, or was accepted
silently, before it was handled."""

from __future__ import annotations

import os

import pytest
import yaml

from tests.helpers import make_config, run_cli, train


def write(tmp_path, name, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def assert_exit_2(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr[-2000:])


def cfg_text(tiny_model_dir, out) -> str:
    return yaml.safe_dump(make_config(tiny_model_dir, out))


CONFIG_CASES = {
    "not UTF-8": (lambda t: t.replace("seed: 1234", "seed: 1234\nnote: caf\xe9").encode("latin-1"), ["not UTF-8 text", ":"]),
    "duplicate section": (lambda t: (t + "training:\n  max_steps: 1\n").encode(), ["duplicate key 'training'"]),
    "alias loop": (lambda t: (t + "loop: &a [*a]\n").encode(), ["an anchor is used inside itself"]),
    "alias bomb": (
        lambda t: (t + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else 'x'}]\n" for i in range(9))).encode(),
        ["alias bomb"],
    ),
    "nested thousands deep": (lambda t: (t + "note: " + "[" * 3000 + "]" * 3000 + "\n").encode(), ["nested more than 64 levels deep", "c.yaml:"]),
    "aliases nested thousands deep": (
        lambda t: (t + "a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 3000))).encode(),
        ["nested more than 64 levels deep (aliases expanded)"],
    ),
    "infinite learning rate": (lambda t: t.replace("learning_rate: 0.002", "learning_rate: .inf").encode(), ["training.learning_rate", "finite"]),
    "unknown attention": (lambda t: t.replace("attn_implementation: sdpa", "attn_implementation: sdpaa").encode(), ["attn_implementation 'sdpaa'"]),
    "device_map without that GPU": (lambda t: t.replace("gradient_checkpointing: false", "gradient_checkpointing: false\n  device_map: cuda:3").encode(), ["model.device_map cuda:3"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_cases(tiny_model_dir, tmp_path, case):
    make, needles = CONFIG_CASES[case]
    path = write(tmp_path, "c.yaml", make(cfg_text(tiny_model_dir, tmp_path / "run")))
    proc = run_cli(["train", path])
    assert_exit_2(proc, *needles)
    assert not (tmp_path / "run").exists()


def test_config_and_data_problems_in_one_message(tiny_model_dir, tmp_path):
    """A schema problem, an unknown override blamed on the command line, a data file that is not
    UTF-8 and one that cannot be read: all four in one run's message."""
    cfg = make_config(tiny_model_dir, tmp_path / "run")
    cfg["training"]["warmup_steps"] = -1
    cfg["data"]["train"] = {
        "path": write(tmp_path, "bad.jsonl", b'{"instruction": "a", "output": "\xff"}\n'),
        "format": "alpaca",
    }
    unreadable = write(tmp_path, "locked.json", b"[]")
    os.chmod(unreadable, 0)
    cfg["data"]["eval"] = {"path": unreadable, "format": "alpaca"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli(["train", str(path), "bogus.x=1"])
    if os.getuid() == 0:  # root reads anything: the unreadable file is read (and empty) here
        assert_exit_2(proc, "training.warmup_steps", "command line: bogus", "bad.jsonl:1: not UTF-8", "no records")
    else:
        assert_exit_2(proc, "training.warmup_steps", "command line: bogus", "bad.jsonl:1: not UTF-8", "cannot be read")


def test_output_dir_below_a_file_or_not_writable(tiny_model_dir, tmp_path):
    (tmp_path / "afile").write_text("x")
    cfg = make_config(tiny_model_dir, tmp_path / "afile" / "run")
    assert_exit_2(train(cfg, tmp_path, expect_ok=False), "is below", "which is a file")


@pytest.mark.parametrize("damage", ["progress.json", "truncated shard", "config.yaml"])
def test_corrupt_checkpoint_to_resume(run_copy, tmp_path, damage):
    run = run_copy("dcp")
    ckpt = run / "checkpoints" / "step-1"
    if damage == "progress.json":
        (ckpt / "progress.json").write_text('{"step": "one"}')
        needle = "progress.json"
    elif damage == "config.yaml":
        (ckpt / "config.yaml").unlink()
        needle = "config.yaml: missing"
    else:
        shard = next((ckpt / "state").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
        needle = "truncated"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "resumed"))
    cfg["training"]["resume"] = str(ckpt)
    assert_exit_2(train(cfg, tmp_path, expect_ok=False), needle)
    assert not (tmp_path / "resumed").exists()


@pytest.mark.parametrize("damage", ["corrupt config.json", "no weights"])
def test_broken_model_folder(tiny_model_dir, tmp_path, damage):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    if damage == "no weights":
        for f in folder.glob("*.safetensors"):
            f.unlink()
        needle = "the folder has no weights"
    else:
        (folder / "config.json").write_text('{"model_type": "olmo2", ')
        needle = "its config cannot be read"
    assert_exit_2(train(make_config(folder, tmp_path / "run"), tmp_path, expect_ok=False), needle)


ARGUMENTS = {
    "plan --nodes 0": (["plan", "{cfg}", "--nodes", "0"], "--nodes must be 1 or more"),
    "plan --gpu-memory nan": (["plan", "{cfg}", "--gpus", "8", "--gpu-memory", "nan"], "--gpu-memory must be a positive"),
    "plan --simulate-world-size -2": (["plan", "{cfg}", "--simulate-world-size", "-2"], "--simulate-world-size must be 1"),
    "plan --gpus -1": (["plan", "{cfg}", "--gpus", "-1"], "--gpus must be 0 or more"),
    "slurm -o DIR": (["slurm", "{cfg}", "--gpus-per-node", "0", "--procs-per-node", "1", "-o", "{tmp}"], "is a directory"),
    "export -o FILE": (["export", "{ckpt}", "-o", "{file}"], "exists and is not a folder"),
    "export --max-shard-size lots": (["export", "{ckpt}", "-o", "{tmp}/out", "--max-shard-size", "lots"], "--max-shard-size 'lots'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_bad_arguments(run_copy, tiny_model_dir, tmp_path, case):
    args, needle = ARGUMENTS[case]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(cfg_text(tiny_model_dir, tmp_path / "run"))
    (tmp_path / "afile").write_text("x")
    ckpt = run_copy("dcp") / "checkpoints" / "step-2" if "{ckpt}" in args else ""
    fill = {"{cfg}": str(cfg), "{tmp}": str(tmp_path), "{file}": str(tmp_path / "afile"), "{ckpt}": str(ckpt)}
    argv = [fill.get(a, a.replace("{tmp}", str(tmp_path))) for a in args]
    assert_exit_2(run_cli(argv), needle)
    assert not (tmp_path / "out").exists(), "a half-written export folder"


@pytest.mark.parametrize("environ", [{"WORLD_SIZE": "abc"}, {"MASTER_PORT": "99999"}, {"RANK": "3", "WORLD_SIZE": "2"}])
def test_doctor_reports_broken_launcher_variables(environ):
    """The very variables the doctor exists to report: a FAIL line, not a crash (exit 1: a check failed)."""
    proc = run_cli(["doctor", "--json"], env=environ)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    import json

    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["distributed variables"]["status"] == "FAIL"


def test_resume_with_max_steps_raised_continues(run_copy, tmp_path):
    """`training.resume: auto` on a finished run with a larger max_steps trains the new steps (it
    used to print the new count, train nothing and exit 0)."""
    run = run_copy("dcp")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["training"].update(resume="auto", max_steps=4)
    proc = train(cfg, tmp_path)
    assert "continuing" in proc.stderr
    from tests.helpers import metrics

    steps = [r["step"] for r in metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 4]

"""The run directory: bad input found after preparation used to write config.yaml first and, under
`overwrite: true`, delete the finished run before failing. Now every input is checked before the
directory is touched, a replaced run is deleted only once the new one passed its checks, a folder
scaletune did not make is never cleared, and two runs cannot share one directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from tests.helpers import losses, make_config, metrics, train


def snapshot(run) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and ".scaletune.lock" not in p.name
    }


BAD = {
    "global batch larger than the data": (
        {"training": {"global_batch_size": 512, "micro_batch_size": 2}},
        "fewer than one global batch",
    ),
    "every response truncated away": ({"data": {"max_seq_length": 8}}, "max_seq_length"),
    "chat template syntax error": (
        {"data": {"chat_template": "{% for m in messages %}{{ m.content }"}},
        "chat_template: line 1",
    ),
    "corrupt checkpoint to resume": (None, "progress.json"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_overwrite_with_bad_input_loses_nothing(run_copy, tmp_path, case):
    run = run_copy("dcp")
    before = snapshot(run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg.update(output_dir=str(run), overwrite=True)
    change, expected = BAD[case]
    if change is None:
        (run / "checkpoints" / "step-1" / "progress.json").write_text("{not json")
        before = snapshot(run)
        cfg.update(overwrite=False)
        cfg["training"]["resume"] = str(run / "checkpoints" / "step-1")
    else:
        for section, values in change.items():
            cfg.setdefault(section, {}).update(values)
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(run) == before, "the finished run was changed"


def test_a_replaced_run_comes_back_when_the_new_one_fails_its_last_checks(run_copy):
    """The mechanism, on a real finished run: prepared for `overwrite`, the old outputs are moved
    aside; a failure inside the last checks (wrap, resume) puts them back byte for byte, success
    deletes them. The lock is released either way."""
    from scaletune.config import read_config
    from scaletune.env import DistributedEnv
    from scaletune.resolve import decide
    from scaletune.run.rundir import lock_holder, opened

    run = run_copy("dcp")
    before = snapshot(run)
    cfg = read_config(run / "config.yaml", ["overwrite=true"]).config
    spec = decide(cfg.model_copy(update={"output_dir": str(run)}), DistributedEnv("none"))
    with pytest.raises(RuntimeError, match="injected"):
        with opened(spec) as run_dir:
            assert not (run / "final").exists() and (run / ".replaced" / "final").is_dir()
            assert lock_holder(run)["pid"] == os.getpid()
            with run_dir.checking():
                raise RuntimeError("injected failure of the last checks")
    after = snapshot(run)
    assert {k: v for k, v in after.items() if k != "config.yaml"} == {
        k: v for k, v in before.items() if k != "config.yaml"
    }
    assert after["config.yaml"] == before["config.yaml"] and lock_holder(run) is None
    with opened(spec) as run_dir:
        with run_dir.checking():
            pass
    assert not (run / ".replaced").exists() and not (run / "final").exists()


def test_overwrite_never_clears_a_folder_scaletune_did_not_make(tiny_model_dir, tmp_path):
    folder = tmp_path / "precious"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "thesis.tex").write_text("years of work")
    (folder / "config.yaml").write_text("not: a scaletune config\n")
    cfg = make_config(tiny_model_dir, folder)
    cfg["overwrite"] = True
    cfg["overwrite"] = True
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2 and "scaletune did not write" in proc.stderr
    assert (folder / "checkpoints" / "thesis.tex").read_text() == "years of work"


def test_a_second_run_on_the_same_directory_exits_2_naming_the_holder(tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "run", training={"max_steps": 40, "save_every": 0})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # Fresh (SCALETUNE_TEST_FORK=0: not handed to the worker's zygote), so the lock's holder is the PID started here.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "SCALETUNE_TEST_FORK": "0"}
    first = subprocess.Popen(
        [sys.executable, "-m", "scaletune", "train", str(path)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "metrics.jsonl").exists():  # the first run holds the lock by now
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.5)
        second = train(
            {**cfg, "training": {**cfg["training"], "resume": "auto"}}, tmp_path, name="c2.yaml", expect_ok=False
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"in use by another run: PID {first.pid}" in second.stderr and "Traceback" not in second.stderr
    finally:
        first.terminate()
        first.wait(timeout=60)
    lines = metrics(tmp_path / "run")
    assert all(r["step"] == i + 1 for i, r in enumerate(r for r in lines if "loss" in r)), "two runs interleaved"


def test_a_stale_lock_is_taken_over(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    # What a run killed before it released its lock leaves: the lock file and its holder's record.
    (run / ".scaletune.lock").touch()
    (run / ".scaletune.lock.holder").write_text(
        json.dumps({"pid": int(dead.stdout), "host": "gone", "started": "then"})
    )
    cfg = make_config(tiny_model_dir, run, training={"max_steps": 1})
    proc = train(cfg, tmp_path)
    assert "took over a stale lock" in proc.stderr and f"PID {int(dead.stdout)} on gone" in proc.stderr
    assert len(losses(run)) == 1 and not (run / ".scaletune.lock.holder").exists()  # released cleanly


def test_the_lock_names_its_holder_and_leaves_no_holder_when_released(tmp_path):
    """In one process (a second open of the lock file contends like another process's): the
    holder is named while the lock is held, the lock is free and unnamed after release."""
    from types import SimpleNamespace

    from scaletune.errors import UserError
    from scaletune.run.rundir import RunDirectory, lock_holder

    run = tmp_path / "run"
    first = RunDirectory(SimpleNamespace(run_dir=run))
    first.acquire()
    try:
        holder = lock_holder(run)
        assert holder is not None and holder["pid"] == os.getpid() and holder["host"]
        with pytest.raises(UserError, match=f"in use by another run: PID {os.getpid()} on "):
            RunDirectory(SimpleNamespace(run_dir=run)).acquire()
    finally:
        first.release()
    assert lock_holder(run) is None and sorted(p.name for p in run.iterdir()) == [".scaletune.lock"]
    second = RunDirectory(SimpleNamespace(run_dir=run))
    second.acquire()  # free again
    second.release()

"""A crafted checkpoint or model folder never runs code: every pickle-bearing file is scanned by a
restricted unpickler before any engine reads it, and refused with exit 2 naming the file and the
global. The payload would `touch` a marker file; the marker never appears."""

from __future__ import annotations

import pickle

import pytest
import torch
import yaml

from tests.helpers import make_config, run_cli, train
from tests.security.payloads import Payload, pickle_payload


def resume(run, tmp_path, marker, **extra):
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "resumed"), overwrite=False)
    cfg["training"]["resume"] = str(run / "checkpoints" / "step-2")
    cfg["training"]["max_steps"] = 3
    cfg["distributed"].update(extra)
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return train(cfg, tmp_path, name="resume.yaml", expect_ok=False)


def assert_refused(proc, marker, *names):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "restricted unpickler" in proc.stderr and "system" in proc.stderr, proc.stderr[-2000:]
    for name in names:
        assert name in proc.stderr
    assert not marker.exists(), "the payload ran"


@pytest.mark.parametrize("target", ["state/.metadata", "rng/rank-0.pt"])
def test_dcp_checkpoint_with_a_payload_is_refused_on_resume_and_export(run_copy, tmp_path, target):
    run = run_copy("dcp")
    marker = tmp_path / "PWNED"
    file = run / "checkpoints" / "step-2" / target
    if target.endswith(".metadata"):
        file.write_bytes(pickle_payload(marker))
    else:
        torch.save({"torch": Payload(marker)}, file)
    assert_refused(resume(run, tmp_path, marker), marker, str(file))
    assert not (tmp_path / "resumed").exists(), "nothing may be written for a refused checkpoint"
    proc = run_cli(["export", str(run / "checkpoints" / "step-2"), "-o", str(tmp_path / "export")])
    assert_refused(proc, marker, str(file))
    assert not (tmp_path / "export").exists()


def test_dcp_pickled_entry_inside_a_shard_is_refused(run_copy, tmp_path):
    """A non-tensor entry of a DCP shard (what optimizer hyper-parameters are stored as) holding a
    payload: written by DCP itself, so the metadata is genuine and only the entry is hostile."""
    import torch.distributed.checkpoint as dcp

    run = run_copy("dcp")
    marker = tmp_path / "PWNED"
    state = run / "checkpoints" / "step-2" / "state"
    for f in state.iterdir():
        f.unlink()
    dcp.save({"model": {"w": torch.zeros(2)}, "optim": {"lr": Payload(marker)}}, checkpoint_id=str(state))
    assert not marker.exists()
    proc = run_cli(["export", str(run / "checkpoints" / "step-2"), "-o", str(tmp_path / "export")])
    assert_refused(proc, marker, "optim.lr")


def test_deepspeed_checkpoint_with_a_payload_is_refused(run_copy, tmp_path):
    run = run_copy("deepspeed")
    marker = tmp_path / "PWNED"
    states = run / "checkpoints" / "step-2" / "deepspeed" / "state"
    target = next(states.glob("*optim_states.pt"))
    torch.save({"optimizer_state_dict": Payload(marker)}, target)
    assert_refused(resume(run, tmp_path, marker), marker, str(target))
    proc = run_cli(["export", str(run / "checkpoints" / "step-2"), "-o", str(tmp_path / "export")])
    assert_refused(proc, marker, str(target))


def test_model_folder_with_pickled_weights_from_a_stranger(tiny_model_dir, tmp_path):
    """A model folder whose `pytorch_model.bin` holds a payload: refused before any model code runs."""
    import shutil

    folder = tmp_path / "stranger-model"
    shutil.copytree(tiny_model_dir, folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    marker = tmp_path / "PWNED"
    torch.save({"lm_head.weight": Payload(marker)}, folder / "pytorch_model.bin")
    cfg = make_config(folder, tmp_path / "run")
    proc = train(cfg, tmp_path, expect_ok=False)
    assert_refused(proc, marker, "pytorch_model.bin")
    assert not (tmp_path / "run").exists()


def test_the_scan_reads_no_code_even_where_torch_would(tmp_path):
    """The control: the same payload does run when loaded with plain pickle (so the tests above
    would notice if the scan let it through)."""
    marker = tmp_path / "PWNED"
    pickle.loads(pickle_payload(marker))
    assert marker.exists()

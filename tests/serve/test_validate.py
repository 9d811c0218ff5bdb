"""A job is checked for the machine that runs it, through the real API: a SLURM job at its nodes x
GPUs per node (the control: what `scaletune slurm` says of the same config and shape), a Modal job
at its `gpu_count` without this host's GPU checks (the control: the same config for `local`, which
this GPU-less host refuses)."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import LORA, make_config, run_cli
from tests.serve.serve_helpers import client

DDP = {"distributed": {"strategy": "ddp"}, "training": {"max_steps": 2, "save_every": 0, "micro_batch_size": 1}}
SHAPE = {"nodes": 2, "gpus_per_node": 8}  # world size 16


def post(server, cfg: dict, target: str, resources: dict, dry_run: bool = True):
    body = {"config": yaml.safe_dump(cfg), "target": target, "resources": resources, "dry_run": dry_run}
    return client(server, server.submit).post("/api/jobs", json=body)


def test_slurm_job_is_checked_at_its_world_size_like_scaletune_slurm(server, tiny_model_dir, tmp_path):
    # 24 sequences split over 16 ranks of one: the batch arithmetic `scaletune slurm` refuses.
    bad = make_config(tiny_model_dir, tmp_path / "bad", DDP, training={"global_batch_size": 24})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    cli = run_cli(["slurm", str(path), "--nodes", "2", "--gpus-per-node", "8"])
    assert cli.returncode == 2 and "training.global_batch_size" in cli.stderr, cli.stderr
    for dry_run in (True, False):
        r = post(server, bad, "slurm", SHAPE, dry_run)
        assert r.status_code == 422, r.text
        batch = [p for p in r.json()["problems"] if "training.global_batch_size" in p]
        assert len(batch) == 1, r.json()
        assert batch[0].split(": ", 1)[1] in cli.stderr, (batch, cli.stderr)  # the same words, but for the file
    # The same config on this host's one process divides: the refusal is the target's shape.
    local = post(server, bad, "local", {})
    assert local.status_code == 200 and local.json()["plan"]["world_size"] == 1, local.text

    good = make_config(tiny_model_dir, tmp_path / "good", DDP, training={"global_batch_size": 32})
    r = post(server, good, "slurm", SHAPE)
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan["world_size"] == 16 and plan["strategy"] == "ddp", plan
    assert "2 node(s) x 8 rank(s) = world size 16" in plan["sbatch_script"]  # what the script starts
    # 32 = 1 x 16 x 2, as the CLI's arithmetic at world size 16 says (the control: no problem at all).
    assert plan["batch"].startswith("global_batch_size 32 = micro_batch_size 1 x world_size 16 x "), plan
    assert plan["batch"].split("gradient_accumulation_steps ")[1].startswith("2;"), plan
    assert not (tmp_path / "bad").exists() and not (tmp_path / "good").exists()


@pytest.mark.parametrize(
    "model",
    [
        pytest.param({**LORA, "quantization": {"bits": 4}}, id="qlora"),
        pytest.param({"liger": True}, id="liger"),
    ],
)
def test_modal_job_skips_this_hosts_gpu_checks(server, tiny_model_dir, tmp_path, model):
    import torch

    cfg = make_config(tiny_model_dir, tmp_path / "run", DDP, model=model, training={"global_batch_size": 4})
    r = post(server, cfg, "modal", {"gpu_count": 2, "gpu_type": "H100"})
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan["world_size"] == 2 and "GPU_COUNT = 2" in plan["modal_app"], plan
    if torch.cuda.is_available():
        pytest.skip("the control needs a host without a GPU")
    local = post(server, cfg, "local", {})
    assert local.status_code == 422, local.text
    assert any("needs a CUDA GPU and none is visible" in p for p in local.json()["problems"]), local.json()

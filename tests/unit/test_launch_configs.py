"""`scaletune config deepspeed|fsdp`'s builders: their options, their checks, and accelerate's config
loader reading the FSDP YAML (the files the CLI writes, read by DeepSpeed and transformers in a
child process: tests/e2e/test_launch_configs.py)."""

from __future__ import annotations

import pytest

from scaletune.errors import UserError
from scaletune.launch.configs import deepspeed_config, fsdp_config


def test_defaults_are_auto_where_the_trainer_fills():
    c = deepspeed_config()
    assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] == c["gradient_accumulation_steps"] == "auto"
    assert c["gradient_clipping"] == "auto" and c["bf16"]["enabled"] == "auto" and c["fp16"]["enabled"] == "auto"
    assert c["zero_optimization"]["stage"] == 2 and "optimizer" not in c


def test_stage3_offload():
    c = deepspeed_config(
        3,
        offload_optimizer=True,
        offload_params=True,
        precision="bf16",
        gradient_accumulation_steps=4,
        gradient_clipping=1.0,
    )
    z = c["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert c["optimizer"]["type"] == "AdamW" and c["bf16"]["enabled"] is True and c["fp16"]["enabled"] is False
    assert c["gradient_accumulation_steps"] == 4 and c["gradient_clipping"] == 1.0


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(zero_stage=4), "--zero-stage"),
        (dict(zero_stage=2, offload_params=True), "needs --zero-stage 3"),
        (dict(gradient_accumulation_steps=0), "--gradient-accumulation-steps"),
        (dict(precision="fp8"), "precision"),
    ],
)
def test_bad_deepspeed_options(kw, message):
    with pytest.raises(UserError, match=message):
        deepspeed_config(**kw)


def test_fsdp_accelerate_yaml_loads_in_accelerate(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    text, suffix = fsdp_config(mixed_precision="bf16", fmt="accelerate")
    assert suffix == ".yaml"
    path = tmp_path / "fsdp.yaml"
    path.write_text(text)
    cfg = load_config_from_file(str(path))
    assert str(cfg.distributed_type).endswith("FSDP") and cfg.mixed_precision == "bf16"
    assert cfg.fsdp_config["fsdp_version"] == 2 and cfg.fsdp_config["fsdp_reshard_after_forward"] is True


def test_bad_fsdp_options():
    with pytest.raises(UserError, match="--mixed-precision"):
        fsdp_config(mixed_precision="fp8")  # type: ignore[arg-type]

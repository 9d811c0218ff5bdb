"""The strategy layer's pure parts: DeepSpeed config generation and merging, the device check,
precision, strategy choice and the number of processes a plain `train` starts."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from scaletune.config import Config
from scaletune.errors import ConfigError, UserError
from scaletune.resolve import decide, precision_for, resolve, wanted_world_size
from scaletune.strategies.base import check_devices
from scaletune.strategies.deepspeed_config import engine_config, read_user_config
from scaletune.strategies.optim import param_groups
from tests.helpers import make_config, make_env


def cfg(dtype: str = "float32", lora: dict | None = None, **distributed) -> Config:
    """make_config's run on 8 dummy rows, 16 sequences a step in micro batches of 2, gradients
    clipped at 0.5, `distributed` over the defaults (the strategy and process count left to decide)."""
    return make_config(
        "m",
        "runs/x",
        as_config=True,
        model={"dtype": dtype, "lora": lora},
        data={"train": None, "dummy": {"num_samples": 8}},
        training={"global_batch_size": 16, "max_grad_norm": 0.5},
        distributed={"strategy": None, "num_processes": None, **distributed},
    )


def ds(c: Config, world=2):
    """The engine's DeepSpeed config (the user's JSON, if the config names one, merged in)."""
    return engine_config(decide(c, make_env(world)))


def test_deepspeed_config_from_yaml():
    out = ds(cfg(strategy="deepspeed", zero_stage=3, offload_params=True, offload_optimizer=True, dtype="bfloat16"))
    assert out["train_batch_size"] == 16
    assert out["train_micro_batch_size_per_gpu"] == 2
    assert out["gradient_accumulation_steps"] == 4
    assert out["gradient_clipping"] == 0.5
    assert out["bf16"] == {"enabled": True} and out["fp16"]["enabled"] is False
    z = out["zero_optimization"]
    assert z["stage"] == 3 and z["stage3_gather_16bit_weights_on_model_save"] is True
    assert z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
    # DeepSpeed's own parser accepts it (without a process group it checks the batch arithmetic
    # at world size 1).
    from deepspeed.runtime.config import DeepSpeedConfig

    one = ds(cfg(strategy="deepspeed", zero_stage=3, offload_params=True, dtype="bfloat16"), world=1)
    parsed = DeepSpeedConfig(json.loads(json.dumps(one)))
    assert parsed.zero_optimization_stage == 3 and parsed.train_batch_size == 16
    assert parsed.gradient_accumulation_steps == 8 and parsed.bfloat16_config.enabled


def test_user_deepspeed_json_merged_keeps_its_own_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
                "communication_data_type": "fp32",
            }
        )
    )
    c = cfg(strategy="deepspeed", zero_stage=2, deepspeed_config=str(path))
    assert read_user_config(str(path))["communication_data_type"] == "fp32"
    out = ds(c)
    assert out["train_batch_size"] == 16
    assert out["zero_optimization"]["reduce_bucket_size"] == 1000
    assert out["communication_data_type"] == "fp32"


def test_user_deepspeed_json_disagreeing_is_one_error_naming_every_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 8,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3},
            }
        )
    )
    c = cfg(strategy="deepspeed", zero_stage=2, deepspeed_config=str(path))
    with pytest.raises(ConfigError) as info:
        ds(c)
    text = "\n".join(info.value.problems)
    assert "train_batch_size is 64 but the YAML gives 16" in text
    assert "gradient_accumulation_steps is 8 but the YAML gives 4" in text
    assert "bf16.enabled is True but model.dtype is float32" in text
    assert "zero_optimization.stage is 3 but distributed.zero_stage is 2" in text
    assert "train_micro_batch_size_per_gpu" not in text  # it agrees


def test_user_deepspeed_json_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_user_config(str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "a": 1,\n  oops\n}')
    with pytest.raises(ConfigError, match=r"bad.json:3: not valid JSON"):
        read_user_config(str(bad))


def test_check_devices_names_offenders():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    check_devices(m, "cpu", strategy="ddp")
    m[1].weight = nn.Parameter(torch.zeros(2, 2, device="meta"))
    m.register_buffer("scale", torch.ones(1, device="meta"))
    with pytest.raises(RuntimeError) as info:
        check_devices(m, "cpu", strategy="ddp")
    msg = str(info.value)
    assert "parameter 1.weight on meta" in msg and "buffer scale on meta" in msg
    assert "strategy ddp expects every parameter and buffer on cpu" in msg
    assert "device_map" in msg  # the fix


def test_precision_keeps_trainable_master_weights_in_fp32():
    full = precision_for(cfg(dtype="bfloat16"), make_env(), "single")
    assert full.compute == "bfloat16" and full.storage == "float32" and full.mixed
    lora = precision_for(cfg(dtype="bfloat16", lora={"r": 4}), make_env(), "single")
    assert lora.storage == "bfloat16" and not lora.mixed
    assert precision_for(cfg(dtype="auto"), make_env(), "single").compute == "float32"  # no GPU here


def test_param_groups_exclude_norms_and_biases_from_decay():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    groups = param_groups(m, 0.1)
    assert groups[0]["weight_decay"] == 0.1 and [p.shape for p in groups[0]["params"]] == [torch.Size([4, 4])]
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 3


def test_choose_strategy():
    assert decide(cfg(), make_env()).strategy == "single"
    assert decide(cfg(), make_env(2)).strategy == "ddp"
    assert decide(cfg(strategy="fsdp"), make_env()).strategy == "fsdp"


def test_wanted_processes():
    assert wanted_world_size(cfg(), make_env()) == 1
    assert wanted_world_size(cfg(), make_env(gpus=4)) == 4  # auto: four GPUs, four processes
    assert wanted_world_size(cfg(num_processes=2), make_env()) == 2  # CPU ranks with gloo
    with pytest.raises(UserError, match="num_processes is 8 but only 4 GPU"):
        resolve(cfg(num_processes=8), make_env(gpus=4))


def test_deepspeed_not_installed_is_bad_input(monkeypatch, tiny_model_dir, tmp_path):
    """`strategy: deepspeed` where DeepSpeed cannot be imported: one clear problem, what to do."""
    import sys

    from scaletune.run import prepare as preflight

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` raise ImportError
    c = make_config(
        tiny_model_dir,
        tmp_path / "run",
        as_config=True,
        data={"train": None, "dummy": {"num_samples": 8}, "max_seq_length": 32},
        distributed={"strategy": "deepspeed", "num_processes": None},
    )
    with pytest.raises(UserError) as info:
        preflight(c, make_env())
    assert info.value.problems == [
        "distributed.strategy deepspeed needs DeepSpeed: pip install 'scaletune[deepspeed]' (or choose ddp or fsdp)"
    ]
    assert not (tmp_path / "run").exists()


def test_unshare_step_counters_gives_each_group_its_own_adam_step():
    """DeepSpeed's ZeRO-3 universal load leaves one `step` tensor in every group's state; AdamW then
    counts each optimizer step once per group. After unsharing, every group counts it once."""
    from scaletune.strategies.deepspeed import unshare_step_counters

    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    (a.sum() + b.sum()).backward()
    opt.step()
    shared = opt.state[a]["step"]
    opt.state[b]["step"] = shared  # what load_hp_checkpoint_state_from_checkpoint_dir_stage3 does
    opt.step()
    assert float(shared) == 3.0  # counted twice in one step: the drift
    shared.fill_(1.0)
    assert unshare_step_counters(opt) == 1
    assert unshare_step_counters(opt) == 0
    opt.step()
    assert float(opt.state[a]["step"]) == 2.0 and float(opt.state[b]["step"]) == 2.0

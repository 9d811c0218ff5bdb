"""`model.mixed_precision` resolved once: bf16_params under single/ddp casts the parameters instead
of autocasting, is a no-op under fsdp/deepspeed (they always cast), and is refused with one message
naming the key where it makes no sense; the planner counts its copies and its smaller activations.
The training itself (parity, dtypes, DDP, resume, measured memory): tests/distributed/test_bf16_params.py."""

from __future__ import annotations

import pytest

from scaletune.errors import ConfigError
from scaletune.plan import plan
from scaletune.resolve import decide, resolve
from tests.helpers import make_config, make_env

GPU = make_env(gpus=1, memory_gib=80)


def cfg(tmp_path, model=None, strategy="single", dist=None, **sections):
    model = {"dtype": "bfloat16", "mixed_precision": "bf16_params", **(model or {})}
    dist = {"strategy": strategy, **(dist or {})}
    return make_config("llama-3.2-1b", tmp_path / "run", as_config=True, model=model, distributed=dist, **sections)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_bf16_params_casts_instead_of_autocasting(tmp_path, strategy):
    p = resolve(cfg(tmp_path, strategy=strategy), GPU, world_size=1 if strategy == "single" else 2).precision
    assert (p.compute, p.storage, p.autocast, p.cast_params) == ("bfloat16", "float32", False, True)
    default = decide(cfg(tmp_path, {"mixed_precision": "autocast"}, strategy), GPU).precision
    assert default.autocast and not default.cast_params  # the default is unchanged


@pytest.mark.parametrize("dist", [{"strategy": "fsdp"}, {"strategy": "deepspeed", "zero_stage": 2}])
def test_a_no_op_where_the_engine_casts_anyway(tmp_path, dist):
    spec = resolve(cfg(tmp_path, dist=dist), make_env(2, gpus=2, memory_gib=80))
    assert not spec.precision.cast_params and not spec.precision.autocast


@pytest.mark.parametrize(
    "model, env, message",
    [
        ({"dtype": "float32"}, GPU, "model.mixed_precision bf16_params computes with bfloat16 copies"),
        ({"dtype": "auto"}, make_env(), "model.dtype is auto (auto resolved to float32 here)"),
        ({"dtype": "float16"}, GPU, "but model.dtype is float16"),
        ({"lora": {"r": 8}}, GPU, "bf16_params is for full fine-tuning"),
        ({"device_map": "auto"}, GPU, "model.device_map auto splits it over several"),
    ],
)
def test_refused_where_it_makes_no_sense(tmp_path, model, env, message):
    with pytest.raises(ConfigError) as info:
        resolve(cfg(tmp_path, model), env)
    assert message in info.value.format()
    resolve(cfg(tmp_path, {**model, "mixed_precision": "autocast"}), env)  # the control: autocast is fine


def test_one_device_maps_are_accepted(tmp_path):
    assert resolve(cfg(tmp_path, {"device_map": "cuda:0"}), GPU).precision.cast_params


def test_planner_counts_the_copies_and_the_smaller_residual_stream(tmp_path):
    """Llama-3.2-1B at 2048 tokens: bf16_params plans the same model states as autocast (fp32
    masters, fp32 gradients, AdamW), a working margin that holds the bf16 copies of the root and two
    layers, and fewer activation bytes (the norm inputs in bf16: 4h bytes a token and layer)."""
    entries = {}
    for mode in ("autocast", "bf16_params"):
        c = cfg(tmp_path, {"mixed_precision": mode, "gradient_checkpointing": False}, data={"max_seq_length": 2048})
        spec = decide(c, GPU)
        entries[mode] = plan(spec, gpu_memory_bytes=80 * 2**30).for_run(spec)
    auto, cast = entries["autocast"], entries["bf16_params"]
    assert (auto.params, auto.grads, auto.optimizer) == (cast.params, cast.grads, cast.optimizer)
    shape = plan(decide(cfg(tmp_path), GPU), gpu_memory_bytes=None).shape
    root = sum(p.numel for p in shape.params if not p.in_layer)
    assert cast.margin - cast.activations // 10 - cast.model_states // 10 >= 2 * root
    tokens = 2048 * c.training.micro_batch_size
    assert auto.activations - cast.activations == tokens * shape.layers * 4 * shape.hidden + tokens * shape.hidden * 4

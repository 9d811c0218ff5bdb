"""The memory planner: exact parameter counts on the meta device, the ZeRO/LoRA/QLoRA accounting,
the strategy choice for Llama-3 shapes, the JSON shape, and the fake-process-group simulation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from scaletune.config import load_config
from scaletune.env import DistributedEnv
from scaletune.plan import (
    ORDER,
    GiB,
    activation_bytes,
    choose_auto,
    choose_checkpointing,
    model_shape,
    plan,
    plan_name,
    simulate_fsdp,
)
from scaletune.resolve import decide, resolve


def cfg_for(name: str, env: DistributedEnv | None = None, **model) -> object:
    """The run of a planner-only preset, decided for `env` (default: one process)."""
    cfg = load_config(
        None,
        data={
            "model": {"name_or_path": name, "dtype": "bfloat16", **model},
            "data": {"dummy": {}, "max_seq_length": 2048},
            "training": {"global_batch_size": 32, "micro_batch_size": 1},
        },
    )
    return decide(cfg, env or DistributedEnv("none"))


@pytest.fixture(scope="module")
def llama8b():
    cfg = cfg_for("llama-3-8b")
    return cfg, model_shape(cfg)


def test_parameter_counts_match_published(llama8b):
    _, shape = llama8b
    assert shape.total == 8_030_261_248  # Meta-Llama-3-8B
    assert model_shape(cfg_for("llama-3.2-1b")).total == 1_235_814_400  # tied embeddings counted once


def test_llama3_8b_on_8x80gib_full(llama8b):
    cfg, shape = llama8b
    p = plan(cfg, world_size=8, gpu_memory_bytes=80 * GiB, shape=shape)
    ddp, fsdp = p.get("ddp"), p.get("fsdp")
    assert ddp.model_states == 16 * shape.total + 4 * len(
        shape.params
    )  # 4 + 4 + 8 bytes per parameter, + a 4-byte step per tensor
    assert 7.9 < ddp.model_states / fsdp.model_states <= 8.01
    assert ddp.fits is False
    assert p.chosen != "ddp" and p.get(p.chosen).fits
    assert p.chosen == "zero1"  # the fastest that fits
    assert "ddp needs" in p.reason and p.reason.count(".") <= 2


def test_llama32_1b_chooses_ddp():
    p = plan(cfg_for("llama-3.2-1b"), world_size=8, gpu_memory_bytes=80 * GiB)
    assert p.chosen == "ddp" and p.get("ddp").fits


def test_json_shape(llama8b):
    cfg, shape = llama8b
    data = plan(cfg, world_size=8, gpu_memory_bytes=80 * GiB, shape=shape).to_json()
    assert set(data) == {"strategies", "chosen", "reason", "reference"}
    assert data["reference"]["mode"] == "none"  # an SFT run: no preference reference
    assert [s["name"] for s in data["strategies"]] == list(ORDER)
    for s in data["strategies"]:
        assert set(s) == {"name", "per_rank_bytes", "fits"}
        b = s["per_rank_bytes"]
        assert set(b) == {"params", "grads", "optimizer", "activations", "reference", "kv_cache", "total"}
        assert b["total"] >= b["params"] + b["grads"] + b["optimizer"] + b["activations"] + b["reference"]
    json.dumps(data)


def test_zero_stages_partition_what_the_paper_says(llama8b):
    cfg, shape = llama8b
    p = plan(cfg, world_size=8, gpu_memory_bytes=None, shape=shape)
    n = shape.total
    z1, z3 = p.get("zero1"), p.get("zero3")
    assert z1.params == 2 * n  # bf16 module replicated
    assert abs(z1.optimizer - 12 * n / 8) < 1e3  # fp32 master + Adam moments, partitioned
    assert abs(z3.params - 2 * n / 8) / (2 * n / 8) < 0.01
    assert p.get("fsdp-offload").params == 0 and p.get("fsdp-offload").host_bytes > 0


def test_lora_only_adapters_train(llama8b):
    p = plan(cfg_for("llama-3-8b", lora={"r": 16}), world_size=8, gpu_memory_bytes=80 * GiB)
    shape = p.shape
    assert shape.trainable == 41_943_040  # r=16 on q,k,v,o,gate,up,down of 32 layers
    ddp = p.get("ddp")
    assert ddp.grads == 4 * shape.trainable
    assert ddp.params == 4 * shape.trainable + 2 * shape.frozen  # frozen base in bf16


def _bnb_4bit_storage(shape: tuple[int, ...], double_quant: bool, device: str) -> list[tuple[tuple[int, ...], str]]:
    """The tensors bitsandbytes stores for a 4-bit NF4 weight of `shape` (as `Params4bit` with its
    defaults, blocksize 64), as (shape, dtype): the packed weight, the per-block absmax and, with
    double quantization, the absmax's own 8-bit state (its fp32 absmax per 256 blocks, code and
    offset). `device="meta"` runs bitsandbytes' own quantize_4bit on a tensor without data (the
    storage it allocates, no kernel run); `"cpu"` quantizes a random weight for real."""
    import bitsandbytes.functional as F  # noqa: N812
    import torch

    if device == "meta":
        w = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    else:
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    tensors = [packed, state.absmax]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return [(tuple(t.shape), str(t.dtype)) for t in tensors]


def _bnb_4bit_bytes(shape: tuple[int, ...], double_quant: bool) -> int:
    """Bytes bitsandbytes stores for a 4-bit NF4 weight of `shape` (:func:`_bnb_4bit_storage` on meta)."""
    import math

    import torch

    storage = _bnb_4bit_storage(shape, double_quant, "meta")
    return sum(math.prod(s) * getattr(torch, dtype.removeprefix("torch.")).itemsize for s, dtype in storage)


@pytest.mark.parametrize("double_quant", [True, False])
def test_qlora_base_bytes_are_bitsandbytes_storage(llama8b, double_quant):
    """The 4-bit base of QLoRA costs what bitsandbytes stores when it quantizes each of those
    weights (measured by bitsandbytes' quantize_4bit on a meta tensor of each shape; the control:
    on the CPU a real weight of the smallest shape is stored in the same tensors), within 0.01%;
    the rest of the frozen model is float32 (peft's prepare_model_for_kbit_training upcasts it) and
    the adapters are float32 master weights."""
    pytest.importorskip("bitsandbytes")
    _, full = llama8b
    quant = {"bits": 4, "double_quant": double_quant}
    p = plan(cfg_for("llama-3-8b", lora={"r": 16}, quantization=quant), world_size=1, gpu_memory_bytes=24 * GiB)
    quantized = [x for x in p.shape.params if x.quantized]
    assert {x.shape for x in quantized} == {(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)}
    on_cpu = _bnb_4bit_storage((1024, 4096), double_quant, "cpu")
    assert on_cpu == _bnb_4bit_storage((1024, 4096), double_quant, "meta"), on_cpu
    real = {shape: _bnb_4bit_bytes(shape, double_quant) for shape in {x.shape for x in quantized}}
    base = sum(real[x.shape] for x in quantized)
    other = p.shape.frozen - sum(x.numel for x in quantized)
    ddp = p.get("ddp")
    assert abs(ddp.params - (base + 4 * other + 4 * p.shape.trainable)) < 1e-4 * base
    if double_quant:  # the default
        assert ddp.params < 0.5 * 2 * full.total  # far below the bf16 model
        assert p.chosen == "ddp" and ddp.fits  # QLoRA of an 8B model fits a 24 GiB GPU


def test_activations_checkpointing_and_attention(llama8b):
    cfg, shape = llama8b
    full = activation_bytes(shape, cfg, checkpointing=False)
    ckpt = activation_bytes(shape, cfg, checkpointing=True)
    assert ckpt < full / 3
    c = cfg.config
    eager = dataclasses.replace(
        cfg, config=c.model_copy(update={"model": c.model.model_copy(update={"attn_implementation": "eager"})})
    )
    s, a = c.data.max_seq_length, shape.heads
    assert (
        activation_bytes(shape, eager, checkpointing=False) - full
        == shape.layers * 2 * a * s * s * 2 - shape.layers * 4 * a * s
    )


def test_plan_names():
    assert plan_name("single") == "ddp"
    assert plan_name("fsdp", offload_params=True) == "fsdp-offload"
    assert plan_name("deepspeed", zero_stage=3) == "zero3"
    assert plan_name("deepspeed", zero_stage=2, offload_optimizer=True) == "zero2-offload"
    assert plan_name("deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True) == "zero3-offload"


def test_gradient_checkpointing_auto_is_on_only_where_the_plan_needs_it():
    """Issue 38: `model.gradient_checkpointing: auto` (the default) is on only where the run's
    strategy does not fit the GPU without it. The controls are the plans of the same run with
    checkpointing written on and off: a GPU between the two totals needs it, one at least the
    larger does not. A CPU has no device memory to plan with: off. A written value stays."""

    def gpu(memory: int) -> DistributedEnv:
        return DistributedEnv(
            "none", cuda_available=True, cuda_device_count=1, device_memory_bytes=memory, bf16_supported=True
        )

    def run(env: DistributedEnv, **model):
        data = {
            "model": {"name_or_path": "llama-3.2-1b", "dtype": "bfloat16", **model},
            "data": {"dummy": {}, "max_seq_length": 4096},
            "training": {"global_batch_size": 8, "micro_batch_size": 8},
            "distributed": {"strategy": "single"},
        }
        return resolve(load_config(None, data=data), env, choose_checkpointing=choose_checkpointing)

    with_it, without = (plan(run(gpu(GiB), gradient_checkpointing=on)).get("ddp").total for on in (True, False))
    assert with_it < without
    tight, roomy = run(gpu((with_it + without) // 2)), run(gpu(without))
    assert tight.config.model.gradient_checkpointing is True and "does not fit without it" in tight.checkpointing_reason
    assert roomy.config.model.gradient_checkpointing is False and "fits without it" in roomy.checkpointing_reason
    cpu = run(DistributedEnv("none"))
    assert (
        cpu.config.model.gradient_checkpointing is False and cpu.checkpointing_reason == "no device memory to plan with"
    )
    written = run(gpu(without), gradient_checkpointing=True)
    assert written.config.model.gradient_checkpointing is True and written.checkpointing_reason == "configured"


def test_choose_auto_strategy(llama8b):
    def choice(name, env):
        c = choose_auto(cfg_for(name, env))
        return c.strategy, {
            k: v
            for k, v in (
                ("zero_stage", c.zero_stage),
                ("offload_optimizer", c.offload_optimizer),
                ("offload_params", c.offload_params),
            )
            if v
        }

    cpu1 = DistributedEnv("none")
    cpu2 = DistributedEnv("torchrun", world_size=2, local_world_size=2)
    assert choice("llama-3-8b", cpu1) == ("single", {})
    assert choice("llama-3-8b", cpu2) == ("ddp", {})
    env8 = DistributedEnv(
        "torchrun",
        world_size=8,
        local_world_size=8,
        cuda_available=True,
        cuda_device_count=8,
        device_memory_bytes=80 * GiB,
        bf16_supported=True,
    )
    assert choice("llama-3-8b", env8) == ("deepspeed", {"zero_stage": 1})
    assert choice("llama-3.2-1b", env8) == ("ddp", {})


def test_simulated_fsdp_70b_at_64_ranks_matches_plan():
    cfg = cfg_for("llama-3-70b")
    sim = simulate_fsdp(cfg, 64)
    planned = plan(cfg, world_size=64, gpu_memory_bytes=None).get("fsdp").params
    assert sim["params_bytes"] == planned
    assert sim["full_bytes"] == 4 * 70_553_706_496
    assert sim["seconds"] < 30


def test_cli_plan_json(tmp_path):
    from typer.testing import CliRunner

    from scaletune.cli import app

    path = tmp_path / "c.yaml"
    path.write_text("model: {name_or_path: llama-3.2-1b}\ndata: {dummy: {}}\n")
    res = CliRunner().invoke(app, ["plan", str(path), "--gpus", "8", "--gpu-memory", "80", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["chosen"] == "ddp"

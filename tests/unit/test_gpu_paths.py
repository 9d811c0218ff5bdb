"""The CUDA paths' decisions, proven on the CPU where the CPU can show them (issue 16): the backend
for FSDP offload under NCCL, FSDP + QLoRA refused, the autocast decision, fp16 loss scaling with
skipped steps, the device a `cuda:N` device_map trains on, FSDP2's root exemption, and the loss with
an offloaded head. The GPU-only halves are in tests/gpu/."""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from scaletune.errors import UserError
from scaletune.models.loss import CausalLMLoss, target_index
from scaletune.resolve import precision_for, resolve
from scaletune.strategies import make_strategy
from scaletune.strategies.process_group import MIXED_BACKEND, select_backend
from tests.helpers import make_config, make_env

CPU = make_env()
GPU = make_env(gpus=2)

# What these runs change in make_config's: bfloat16, 16 sequences a step, 2 steps, no checkpoints.
RUN = {"model": {"dtype": "bfloat16"}, "training": {"global_batch_size": 16, "max_steps": 2, "save_every": 0}}


def config(**sections):
    """make_config's config with RUN and `sections` for a model that need not exist (nothing loads it)."""
    return make_config("runs/models/x", "runs/x", RUN, as_config=True, **sections)


# -- 1: the backend -----------------------------------------------------------------------------


def test_backend_is_mixed_where_nccl_meets_cpu_tensors():
    assert select_backend("auto", cuda_available=True) == "nccl"
    assert select_backend("auto", cuda_available=True, cpu_collectives=True) == MIXED_BACKEND == "cpu:gloo,cuda:nccl"
    assert select_backend("nccl", cuda_available=True, cpu_collectives=True) == MIXED_BACKEND
    assert select_backend("auto", cuda_available=False, cpu_collectives=True) == "gloo"
    assert select_backend("gloo", cuda_available=True, cpu_collectives=True) == "gloo"
    with pytest.raises(RuntimeError, match="nccl needs CUDA"):
        select_backend("nccl", cuda_available=False)


def test_fsdp_asks_for_cpu_collectives_exactly_when_offloading(monkeypatch):
    """The backend each strategy's setup starts the process group with on rank 0 of 2 GPUs: NCCL,
    with gloo beside it exactly when FSDP offloads parameters (the call is recorded, not made)."""
    import torch.distributed as dist

    started: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: started.append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for var, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = make_env(2, gpus=2)
    # setup sets TF32 for a bf16 run on GPUs; tests/conftest.py's `_tf32_restored` turns it back
    for section in ({"strategy": "fsdp"}, {"strategy": "fsdp", "offload_params": True}, {"strategy": "ddp"}):
        make_strategy(resolve(config(distributed=section), env)).setup()
    assert started == ["nccl", "cpu:gloo,cuda:nccl", "nccl"]


# -- 2: FSDP + QLoRA ----------------------------------------------------------------------------


def test_fsdp_with_quantization_is_refused_with_the_alternative():
    """Refused before anything loads, naming what runs instead (the CLI's exit 2 for it:
    tests/e2e/test_preflight_cli.py); the same model under ZeRO-3 is not refused by that rule."""
    qlora = {"lora": {"r": 8}, "quantization": {"bits": 4, "storage_dtype": "bfloat16"}}
    env = make_env(2, gpus=2)
    with pytest.raises(UserError) as info:
        resolve(config(model=qlora, distributed={"strategy": "fsdp", "num_processes": 2}), env)
    text = info.value.format()
    assert "model.quantization cannot run under strategy fsdp" in text
    assert "use strategy ddp" in text and "zero_stage 3" in text
    resolve(config(model=qlora, distributed={"strategy": "deepspeed", "zero_stage": 3, "num_processes": 2}), env)


def test_the_planner_never_picks_fsdp_for_a_quantized_model(tmp_path):
    from scaletune.plan import GiB, plan

    env = make_env(8, gpus=8, memory_gib=24)
    cfg = make_config(
        "llama-3-70b",
        "runs/x",
        RUN,
        as_config=True,
        model={
            "lora": {"r": 16},
            "quantization": {"bits": 4, "storage_dtype": "bfloat16"},
            "gradient_checkpointing": True,
        },
        distributed={"strategy": "ddp"},
        data={"max_seq_length": 2048},
    )
    p = plan(resolve(cfg, env), gpu_memory_bytes=24 * GiB)
    # fsdp fits and comes before zero3 in the planner's order: only the exclusion keeps it out.
    assert p.get("fsdp").fits and not p.get("zero2").fits
    assert p.chosen.startswith("zero3"), p.reason


# -- 3: the autocast decision -------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, strategy, want",
    [
        ({}, "single", True),  # full fine-tuning: fp32 masters, bf16 compute
        ({"lora": {"r": 8}}, "single", True),  # LoRA: peft's adapters are fp32 over a bf16 base
        ({"lora": {"r": 8}, "quantization": {"bits": 4}}, "ddp", True),  # QLoRA: k-bit prep upcasts norms
        ({"lora": {"r": 8}, "dtype": "float32"}, "single", False),  # nothing is wider than fp32
        ({"dtype": "float32"}, "ddp", False),
        ({"lora": {"r": 8}}, "fsdp", False),  # FSDP2's MixedPrecisionPolicy casts every parameter
        ({"lora": {"r": 8}, "quantization": {"bits": 4}}, "deepspeed", False),  # DeepSpeed's bf16 mode
    ],
)
def test_autocast_whenever_a_parameter_is_wider_than_compute(model, strategy, want):
    p = precision_for(config(model=model), GPU, strategy)
    assert p.autocast is want, p


def test_qlora_storage_is_the_compute_dtype_and_still_autocasts():
    p = precision_for(config(model={"lora": {"r": 8}, "quantization": {"bits": 4}}), GPU, "single")
    assert (p.compute, p.storage, p.autocast) == ("bfloat16", "bfloat16", True)


# -- 4: fp16 loss scaling -----------------------------------------------------------------------


def fp16_run(tiny_model_dir, tmp_path, scaler: bool, init_scale: float = 2.0**8):
    """One real optimizer step of the tiny model in fp16 on the CPU (GradScaler or none)."""
    from scaletune.data import Collator
    from scaletune.models import load_tokenizer, prepare_model
    from scaletune.strategies import torn_down
    from scaletune.trainer import seed_everything, train_step

    cfg = make_config(tiny_model_dir, tmp_path / "run", RUN, as_config=True, model={"dtype": "float16"})
    spec = resolve(cfg, CPU)
    strategy = make_strategy(spec)
    tok = load_tokenizer(cfg.model)
    rows = [{"input_ids": list(range(5, 40)), "labels": [-100] * 10 + list(range(15, 40))} for _ in range(2)]
    batch = Collator(tok.pad_token_id)(rows)
    with torn_down(strategy):
        seed_everything(0)
        model = prepare_model(cfg.model.model_copy(update={"dtype": "float32"}), strategy.placement)
        strategy.wrap(CausalLMLoss(model))
        assert isinstance(strategy.scaler, torch.amp.GradScaler)  # float16 outside DeepSpeed
        strategy.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if scaler else None
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        result = train_step(strategy, [batch])
        after = dict(model.named_parameters())
        moved = max(float((after[n] - before[n]).abs().max()) for n in before)
        return result, moved, strategy


def test_fp16_loss_scaling_unscales_before_clipping(tiny_model_dir, tmp_path):
    """With a scaler the reported norm and the update equal the unscaled ones: the gradients are
    divided by the scale before clipping (a scaler without unscale_ would report 256x the norm)."""
    scaled, moved_scaled, _ = fp16_run(tiny_model_dir, tmp_path, scaler=True)
    plain, moved_plain, _ = fp16_run(tiny_model_dir, tmp_path, scaler=False)
    assert not scaled.skipped and moved_scaled > 0
    assert math.isclose(float(scaled.grad_norm), float(plain.grad_norm), rel_tol=2e-2)
    assert math.isclose(moved_scaled, moved_plain, rel_tol=5e-2)


def test_an_overflowing_fp16_step_is_skipped_and_is_not_divergence(tiny_model_dir, tmp_path):
    from scaletune.run.rundir import opened
    from scaletune.trainer import DivergenceError, StepResult, Trainer
    from scaletune.trainer.metrics import RunLogger, ThroughputWindow

    result, moved, strategy = fp16_run(tiny_model_dir, tmp_path, scaler=True, init_scale=2.0**80)
    assert result.skipped and moved == 0.0  # no weight changed
    assert not math.isfinite(float(result.grad_norm)) and math.isfinite(float(result.loss))
    assert strategy.scaler.get_scale() == 2.0**79  # backed off

    trainer = Trainer(strategy.spec, open_run_dir=opened)
    (tmp_path / "log").mkdir()
    trainer.logger = RunLogger(tmp_path / "log", CPU, strategy.spec.config)
    plan = SimpleNamespace(stage=SimpleNamespace(name="main"), steps_per_epoch=4, total=4)
    trainer.prepared = SimpleNamespace(plans=[plan])  # the loop's prepared stages (total_steps)
    trainer.position.advance(0, 0)
    trainer.log_step(plan, 1e-3, result, ThroughputWindow())  # skipped: logged, not raised
    trainer.position.advance(0, 1)
    with pytest.raises(DivergenceError):
        trainer.log_step(plan, 1e-3, StepResult(result.loss, result.grad_norm, result.tokens), ThroughputWindow())
    trainer.logger.close()
    assert '"skipped": true' in (tmp_path / "log" / "metrics.jsonl").read_text()


def test_no_scaler_for_bf16_or_deepspeed_fp16():
    env = make_env(launcher="torchrun")
    assert make_strategy(resolve(config(), CPU)).make_scaler() is None  # bf16 needs none
    ds = make_strategy(resolve(config(model={"dtype": "float16"}, distributed={"strategy": "deepspeed"}), env))
    assert ds.make_scaler() is None  # DeepSpeed's fp16 mode scales its own loss


# -- 6: the device a device_map trains on ------------------------------------------------------


def test_device_map_cuda_n_is_where_batches_and_the_check_go():
    spec = resolve(config(model={"device_map": "cuda:1"}), GPU)
    strategy = make_strategy(spec)
    assert strategy.placement.device_map == {"": "cuda:1"}
    assert strategy.device == torch.device("cuda:1") != spec.env.device  # the process default is cuda:0
    default = make_strategy(resolve(config(), GPU))
    assert default.device == torch.device("cuda:0")
    assert make_strategy(resolve(config(), CPU)).device == torch.device("cpu")


# -- 13: FSDP2's root exemption ------------------------------------------------------------------


def test_fsdp_root_stays_gathered_after_forward_and_layers_reshard(tiny_model_dir):
    """After a forward, FSDP2 registers sharded parameters (DTensor) on modules it resharded and
    unsharded ones on modules it kept gathered. The one sharding function leaves the root's
    embeddings and head gathered for backward (root exemption) and reshards each decoder layer."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from scaletune.models import decoder_layer_classes
    from scaletune.strategies.parallel.parallelize import shard_model
    from scaletune.strategies.process_group import free_port

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shard_model(model, tuple(decoder_layer_classes(model)), reshard_after_forward=True)
        model(input_ids=torch.arange(8)[None]).logits.sum()
        assert not isinstance(model.model.embed_tokens.weight, DTensor)  # root: kept for backward
        assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)  # layer: resharded
    finally:
        dist.destroy_process_group()


# -- 5: the loss with a head offloaded by a device_map -----------------------------------------


def test_loss_with_an_offloaded_head_equals_the_loss_in_place(tiny_llama_dir):
    """accelerate's offload (what device_map with cpu/disk entries does) leaves lm_head.weight on the
    meta device outside the head's forward: the loss must call the head, not read its weight."""
    from accelerate import cpu_offload
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100
    with torch.no_grad():
        want = CausalLMLoss(model)(ids, labels, target_index(labels))
        offloaded = copy.deepcopy(model)
        cpu_offload(offloaded, execution_device="cpu")
        assert offloaded.lm_head.weight.device.type == "meta"
        calls = []
        offloaded.lm_head.register_forward_hook(lambda *args: calls.append(1))
        got = CausalLMLoss(offloaded)(ids, labels, target_index(labels))
    # The CPU lets a matmul read a meta weight's storage; a GPU does not. So the proof here is that
    # the head's forward ran (its hook loads the weight onto the execution device), and the value.
    assert calls, "the loss read lm_head.weight directly instead of calling the offloaded head"
    assert torch.allclose(got, want, rtol=1e-5), (float(got), float(want))


# -- issue 20: ZeRO-3 keeps model.quantization ------------------------------------------------


@contextlib.contextmanager
def _zero3_announced():
    """A ZeRO-3 config announced to transformers as the DeepSpeed strategy announces it (its own
    HfDeepSpeedConfig, which transformers holds by a weak reference only: kept alive here)."""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    announced = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        yield announced
    finally:
        unset_hf_deepspeed_config()


def test_zero3_loads_a_quantized_base_quantized_on_the_ranks_gpu(tiny_model_dir, monkeypatch):
    """Under an announced ZeRO-3 config a QLoRA base is loaded with bitsandbytes' config, whole, on
    the rank's GPU: transformers skips zero.Init for quantized models and DeepSpeed partitions the
    model at initialize. Through transformers' real `from_pretrained`, which refuses any device_map
    while ZeRO-3 is announced (`check_and_set_device_map`): the loader passes none, and the real
    bitsandbytes quantizer puts the model on `torch.cuda.current_device()`, the GPU the process
    group's setup made the rank's. Only the GPU is pretended (visible, current device 1); the load
    stops where it would first touch it, after transformers decided the placement."""
    import transformers.modeling_utils as mu

    from scaletune.config import LoraConfig, ModelConfig, QuantizationConfig
    from scaletune.models import load_model
    from scaletune.models.placement import DevicePlacement

    pytest.importorskip("bitsandbytes")  # imported now, on the CPU: a pretended GPU would pick its CUDA backend
    decided: dict = {}
    real_quantizer = mu.get_hf_quantizer

    def quantizer_then_stop(config, quantization_config, device_map, *args, **kwargs):
        hf_quantizer, config, device_map = real_quantizer(config, quantization_config, device_map, *args, **kwargs)
        decided.update(quantizer=hf_quantizer, device_map=device_map)
        raise _DeviceBoundary  # the next step allocates on the GPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(mu, "get_hf_quantizer", quantizer_then_stop)
    qlora = ModelConfig(
        name_or_path=str(tiny_model_dir),
        dtype="bfloat16",
        lora=LoraConfig(),
        quantization=QuantizationConfig(bits=4, storage_dtype="bfloat16"),
    )
    with _zero3_announced(), pytest.raises(_DeviceBoundary):
        load_model(qlora, DevicePlacement(None, "cuda:1"))
    q = decided["quantizer"].quantization_config
    assert q.load_in_4bit and q.bnb_4bit_quant_storage == torch.bfloat16, "ZeRO-3 dropped model.quantization"
    assert decided["device_map"] == {"": 1}  # bitsandbytes' placement: the rank's GPU, whole

    # Without quantization ZeRO-3 gets no device_map either (zero.Init places the partitions).
    decided.clear()
    with _zero3_announced(), pytest.raises(_DeviceBoundary):
        load_model(ModelConfig(name_or_path=str(tiny_model_dir), dtype="bfloat16"), DevicePlacement(None, "cuda:1"))
    assert decided == {"quantizer": None, "device_map": None}


class _DeviceBoundary(Exception):
    """Where a test that pretends a GPU stops, before anything is allocated on it."""


# -- issue 20: TF32 read back through every getter --------------------------------------------


def _tf32_getters() -> dict:
    """Every way torch (and Inductor) reads the fp32 matmul / convolution precision."""
    getters = {
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    }
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch 2.9+
        getters["cuda.matmul.fp32_precision"] = lambda: torch.backends.cuda.matmul.fp32_precision
        getters["cudnn.conv.fp32_precision"] = lambda: torch.backends.cudnn.conv.fp32_precision
    return {name: get() for name, get in getters.items()}


def test_tf32_of_a_bf16_gpu_run_reads_back_through_every_getter(monkeypatch):
    """A bf16 run's setup on (pretended) GPUs turns TF32 on; afterwards every getter must read
    without raising (torch 2.9+ raises on the legacy ones after the new setter alone) and agree."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for var, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = make_env(2, gpus=2)
    before = torch.get_float32_matmul_precision()
    assert before == "highest", "another test left TF32 on"
    try:
        make_strategy(resolve(config(distributed={"strategy": "ddp"}), env)).setup()
        seen = _tf32_getters()
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen["cuda.matmul.allow_tf32"] is True and seen["get_float32_matmul_precision"] == "high"
    assert seen["cudnn.allow_tf32"] is True
    if "cuda.matmul.fp32_precision" in seen:
        assert seen["cuda.matmul.fp32_precision"] == "tf32" and seen["cudnn.conv.fp32_precision"] == "tf32"
    # and back to IEEE fp32, still readable
    assert _tf32_getters()["cuda.matmul.allow_tf32"] is False

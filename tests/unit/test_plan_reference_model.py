"""The planner's `reference` entry (issue 24): per strategy, what the frozen reference model of
`preference.reference: model` holds per rank, against a real tiny model loaded the way the run loads
it (`PretrainedSource.load_reference`) and, for fsdp, really sharded by THE FSDP2 function over a fake
process group; `base` and `precomputed` hold nothing; `strategy: auto` chooses differently once the
reference is counted. (ZeRO-3's numbers are checked against real ranks in
tests/distributed/test_reference_model.py.)"""

from __future__ import annotations

import pytest

from scaletune.config import load_config
from scaletune.config.schema import TrainingConfig
from scaletune.env import DistributedEnv
from scaletune.plan import GiB, plan
from scaletune.resolve import decide

pytestmark = pytest.mark.skipif(
    "objective" not in TrainingConfig.model_fields, reason="training.objective is not in the config schema yet"
)

GPUS2 = DistributedEnv(
    "torchrun",
    world_size=2,
    local_world_size=2,
    cuda_available=True,
    cuda_device_count=2,
    device_memory_bytes=None,
    bf16_supported=True,
)


def spec_for(model: str, reference: str | None, *, env=None, objective="dpo", dtype="float32", lora=None, **dist):
    training = {"global_batch_size": 8, "micro_batch_size": 1, "objective": objective}
    if reference is not None:
        training["preference"] = {"reference": reference}
    cfg = load_config(
        None,
        data={
            "model": {"name_or_path": str(model), "dtype": dtype, "lora": lora, "gradient_checkpointing": False},
            "data": {"dummy": {}, "max_seq_length": 64},
            "training": training,
            "distributed": {"strategy": "ddp", "num_processes": 2, **dist},
        },
    )
    return decide(cfg, env or GPUS2, world_size=2)


def loaded_reference_bytes(spec) -> int:
    """The reference as `PretrainedSource.load_reference` loads it in one process (`single`: whole,
    on the CPU), its parameter bytes counted from the tensors (each storage once)."""
    from scaletune.strategies import memory
    from scaletune.strategies.frozen_reference import reference_tensors
    from scaletune.strategies.single import SingleStrategy
    from scaletune.trainer.model_source import PretrainedSource

    one = decide(spec.config.model_copy(deep=True), DistributedEnv("none"), world_size=1)
    strategy = SingleStrategy(one)
    ref = PretrainedSource(one).load_reference(strategy)
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    return memory.count_bytes(reference_tensors(ref), {})


def test_model_reference_whole_is_the_real_models_bytes(tiny_model_dir):
    """ddp keeps the reference whole in the storage dtype (float32 for a full fine-tune, what the
    policy loads in); ZeRO-1/2 as DeepSpeed casts it (the compute dtype: bfloat16 here)."""
    import torch

    full = spec_for(tiny_model_dir, "model")
    real = loaded_reference_bytes(full)
    p = plan(full, world_size=2)
    assert p.get("ddp").reference == real
    assert p.reference is not None and p.reference.mode == "model"
    # Loaded by the reference's own path, the model is float32 here: ZeRO-1/2 store it in bf16.
    bf16 = spec_for(tiny_model_dir, "model", dtype="bfloat16")
    assert bf16.precision.storage == "float32" and bf16.precision.compute == "bfloat16"
    half = plan(bf16, world_size=2)
    assert half.get("ddp").reference == real  # float32 storage, whole
    n = real // 4
    assert half.get("zero1").reference == half.get("zero2").reference == n * torch.finfo(torch.bfloat16).bits // 8


def test_model_reference_without_adapters(tiny_model_dir):
    """Under LoRA the reference is the base model alone (no adapter), stored in the compute dtype."""
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "auto"}
    spec = spec_for(tiny_model_dir, "model", lora=lora)
    real = loaded_reference_bytes(spec)
    p = plan(spec, world_size=2)
    assert any("lora_" in q.name for q in p.shape.params)
    assert p.get("ddp").reference == real
    assert p.get("ddp").reference < 4 * p.shape.total  # the adapters are not in it


def test_model_reference_fsdp_is_the_real_shard(tiny_model_dir):
    """fsdp: rank 0's shard of the real reference, sharded by THE FSDP2 function over a fake process
    group of 2 (the planner's count is of rank 0, which holds the largest shard)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scaletune.models import decoder_layer_classes
    from scaletune.strategies.frozen_reference import freeze
    from scaletune.strategies.parallel.parallelize import shard_model
    from scaletune.strategies.single import SingleStrategy
    from scaletune.trainer.model_source import PretrainedSource

    spec = spec_for(tiny_model_dir, "model", strategy="fsdp")
    one = decide(spec.config.model_copy(update={}), DistributedEnv("none"), world_size=1)
    ref = freeze(PretrainedSource(one).load_reference(SingleStrategy(one)).causal_lm)
    full = sum(p.numel() * p.element_size() for p in ref.parameters())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        shard_model(ref, tuple(decoder_layer_classes(ref)), mesh=mesh, no_backward=True)
        local = sum(p.to_local().numel() * p.to_local().element_size() for p in ref.parameters())
    finally:
        dist.destroy_process_group()
    p = plan(spec, world_size=2)
    assert p.get("fsdp").reference == local
    assert abs(local - full / 2) <= 0.01 * full
    assert p.get("fsdp-offload").reference == 0 and p.get("fsdp-offload").host_bytes >= local


@pytest.mark.parametrize("mode", ["base", "precomputed", "auto"])
def test_no_second_model(tiny_model_dir, mode):
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "auto"} if mode == "base" else None
    spec = spec_for(tiny_model_dir, mode, lora=lora)
    p = plan(spec, world_size=2)
    assert all(s.reference == 0 for s in p.strategies)
    want = "base" if mode == "base" else "precomputed"
    assert p.reference.mode == want
    if want == "precomputed":
        assert "2 float32 per pair" in p.reference.note and "negligible" in p.reference.note
    assert p.to_json()["reference"]["mode"] == want
    assert all(s["per_rank_bytes"]["reference"] == 0 for s in p.to_json()["strategies"])


@pytest.mark.parametrize("objective", ["sft", "orpo", "simpo"])
def test_objectives_without_reference_hold_none(tiny_model_dir, objective):
    from scaletune.plan.reference_model import stage_reference

    spec = spec_for(tiny_model_dir, "model", objective=objective)
    assert stage_reference(spec.stages[0].training, lora=False) == "none"
    p = plan(spec, world_size=2)
    assert p.reference.mode == "none" and all(s.reference == 0 for s in p.strategies)


def test_reference_in_total_and_table(tiny_model_dir):
    from rich.console import Console

    from scaletune.plan import render_table

    with_ref = plan(spec_for(tiny_model_dir, "model"), world_size=2)
    without = plan(spec_for(tiny_model_dir, "precomputed"), world_size=2)
    for name in ("ddp", "fsdp", "zero3"):
        a, b = with_ref.get(name), without.get(name)
        assert a.total - b.total == a.reference + (a.margin - b.margin) and a.reference > 0
        assert a.to_json()["per_rank_bytes"]["reference"] == a.reference
    console = Console(width=200, record=True)
    console.print(render_table(with_ref))
    text = " ".join(console.export_text().split())  # the caption wraps
    assert "reference" in text and "sharded 1/W under fsdp and ZeRO-3" in text


def test_auto_strategy_accounts_for_the_reference():
    """Llama-3-8B, full fine-tune in bf16 on 8 GPUs of 40 GiB: with the reference precomputed ZeRO-2
    fits; with a resident reference (+15 GiB whole under ZeRO-1/2) it no longer does, and `auto`
    moves to a strategy that shards the reference (fsdp, 1/8 of it per rank)."""
    from scaletune.plan import choose_auto

    env8 = DistributedEnv(
        "torchrun",
        world_size=8,
        local_world_size=8,
        cuda_available=True,
        cuda_device_count=8,
        device_memory_bytes=40 * GiB,
        bf16_supported=True,
    )

    def run(reference):
        cfg = load_config(
            None,
            data={
                "model": {"name_or_path": "llama-3-8b", "dtype": "bfloat16", "gradient_checkpointing": True},
                "data": {"dummy": {}, "max_seq_length": 512},
                "training": {
                    "global_batch_size": 32,
                    "micro_batch_size": 1,
                    "objective": "dpo",
                    "preference": {"reference": reference},
                },
            },
        )
        spec = decide(cfg, env8)
        return spec, choose_auto(spec)

    spec_pre, pre = run("precomputed")
    spec_model, model = run("model")
    assert (pre.strategy, pre.zero_stage) == ("deepspeed", 2)
    assert model.strategy == "fsdp" and not model.offload_params
    p = plan(spec_model, gpu_memory_bytes=40 * GiB)
    assert p.get("zero2").fits is False and p.get("fsdp").fits
    assert p.get("fsdp").reference * 8 == pytest.approx(p.get("ddp").reference, rel=1e-3)


def test_factory_has_no_reference_model(tiny_model_dir):
    """A factory's module has no Hugging Face causal LM to copy: `load_reference` says so (the
    planner counts none for it)."""
    from scaletune.errors import UserError
    from scaletune.trainer.model_source import FactorySource

    spec = spec_for(tiny_model_dir, "model")
    with pytest.raises(UserError, match="reference: model needs a Hugging Face causal LM"):
        FactorySource(spec).load_reference(None)


def test_a_distillation_teacher_is_planned_at_its_own_size(tiny_model_dir, tmp_path, caplog):
    """The teacher of objective distill (a Llama of hidden 128 and 4 layers for the olmo2-tiny
    student, the same tokenizer) is counted from its own config: under ddp its bytes are those of the
    teacher `load_reference` really loads, not the student's; fsdp holds about half at world size 2."""
    from scaletune.strategies import memory
    from scaletune.strategies.frozen_reference import reference_tensors
    from scaletune.strategies.single import SingleStrategy
    from scaletune.trainer.model_source import PretrainedSource
    from tests.helpers import save_teacher_llama

    big = save_teacher_llama(tmp_path / "teacher", tiny_model_dir)
    cfg = load_config(
        None,
        data={
            "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "gradient_checkpointing": False},
            "data": {"dummy": {}, "max_seq_length": 64},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, "objective": "distill",
                         "distill": {"teacher": str(big)}},
            "distributed": {"strategy": "ddp", "num_processes": 2},
        },
    )  # fmt: skip
    spec = decide(cfg, GPUS2, world_size=2)
    one = decide(cfg.model_copy(deep=True), DistributedEnv("none"), world_size=1)
    with caplog.at_level("INFO"):
        teacher = PretrainedSource(one).load_reference(SingleStrategy(one), str(big))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"model {big}: ")]
    count = sum(p.numel() for p in teacher.parameters())  # torch's own count (shared tensors once)
    assert said == [f"model {big}: {count:,} parameters, frozen (not trained)"], said  # never "trainable"
    real = memory.count_bytes(reference_tensors(teacher), {})
    student = loaded_reference_bytes(spec_for(tiny_model_dir, "model"))
    assert real > 1.5 * student  # the control: a plan of the student's size would be far off
    p = plan(spec, world_size=2)
    assert p.reference.mode == "model" and "distillation teacher" in p.reference.note
    assert p.get("ddp").reference == real
    assert 0.45 * real <= p.get("fsdp").reference <= 0.55 * real

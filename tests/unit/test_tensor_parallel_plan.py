"""scaletune.strategies.parallel.tensor without processes: transformers' style names mapped to torch
styles with transformers' layouts, the plan expanded from the model's own `base_model_tp_plan` (plain
and peft-wrapped), refusals, and the shards `apply_tensor_parallel` makes on a meta-device model over
a fake process group of 2 (the numerics are in tests/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from scaletune.strategies.parallel.tensor import (
    _check_divisible,
    base_model,
    parallel_style,
    tensor_parallel_plan,
)

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(kind: str = "llama", **overrides):
    """A 2-layer model on the meta device (no storage)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Olmo2Config

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    sizes.update(intermediate_size=128, vocab_size=256, max_position_embeddings=64, **overrides)
    config = Olmo2Config(**sizes) if kind == "olmo2" else LlamaConfig(**sizes)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS))


def layouts(style):
    return type(style), style.input_layouts, style.output_layouts, style.use_local_output


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("colwise", (ColwiseParallel, (Replicate(),), (Shard(-1),), True)),
        ("rowwise", (RowwiseParallel, (Shard(-1),), (Replicate(),), True)),
        # transformers: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        ("colwise_gather_output", (ColwiseParallel, (Replicate(),), (Replicate(),), True)),
        # transformers: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        ("rowwise_split_input", (RowwiseParallel, (Replicate(),), (Replicate(),), True)),
    ],
)
def test_style_names_map_to_transformers_layouts(name, want):
    assert layouts(parallel_style(name)) == want


@pytest.mark.parametrize("name", ["packed_colwise", "sequence_parallel", "embedding_rowwise", "nonsense"])
def test_unmapped_style_is_refused_by_name(name):
    with pytest.raises(ValueError, match=name):
        parallel_style(name)


def test_llama_plan_names_every_projection_of_every_layer():
    model = tiny()
    assert base_model(model) is model.model
    plan = tensor_parallel_plan(model)
    assert len(plan) == 2 * 7
    assert plan["layers.1.self_attn.q_proj"] == "colwise"
    assert plan["layers.0.self_attn.o_proj"] == "rowwise"
    assert plan["layers.0.mlp.down_proj"] == "rowwise"
    assert all(isinstance(model.model.get_submodule(n), torch.nn.Linear) for n in plan)


def test_olmo2_plan_gathers_attention_outputs():
    plan = tensor_parallel_plan(tiny("olmo2"))
    assert plan["layers.0.self_attn.k_proj"] == "colwise_gather_output"
    assert plan["layers.0.self_attn.o_proj"] == "rowwise_split_input"
    assert plan["layers.0.mlp.up_proj"] == "colwise"


def test_lora_plan_shards_the_base_layer_and_the_adapter_factor_on_its_side():
    model = with_lora(tiny())
    assert base_model(model) is model.get_base_model().model
    plan = tensor_parallel_plan(model)
    assert len(plan) == 2 * 7 * 2
    attn = "layers.0.self_attn"
    assert plan[f"{attn}.q_proj.base_layer"] == plan[f"{attn}.q_proj.lora_B.default"] == "colwise"
    assert plan[f"{attn}.o_proj.base_layer"] == plan[f"{attn}.o_proj.lora_A.default"] == "rowwise"
    assert f"{attn}.q_proj.lora_A.default" not in plan and f"{attn}.o_proj.lora_B.default" not in plan


def test_lora_plan_on_olmo2_keeps_the_gather_and_split_styles():
    plan = tensor_parallel_plan(with_lora(tiny("olmo2")))
    assert plan["layers.1.self_attn.v_proj.lora_B.default"] == "colwise_gather_output"
    assert plan["layers.1.self_attn.o_proj.lora_A.default"] == "rowwise_split_input"


def test_model_without_a_plan_is_refused():
    model = tiny()
    model.config.base_model_tp_plan = None
    with pytest.raises(ValueError, match="base_model_tp_plan"):
        tensor_parallel_plan(model)


def test_unmapped_style_in_the_plan_is_refused():
    model = tiny()
    model.config.base_model_tp_plan = {"layers.*.mlp.up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="packed_colwise"):
        tensor_parallel_plan(model)


def test_dora_is_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny(), LoraConfig(r=4, target_modules=PROJECTIONS, use_dora=True))
    with pytest.raises(ValueError, match="DoRA"):
        tensor_parallel_plan(model)


def test_widths_and_heads_must_divide_by_the_tensor_parallel_size():
    model = tiny()
    plan = tensor_parallel_plan(model)
    _check_divisible(model, plan, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        _check_divisible(model, plan, 4)
    with pytest.raises(ValueError, match="not divisible by 3"):
        _check_divisible(model, plan, 3)


@pytest.mark.parametrize("case", ["llama", "lora", "tied"])
def test_apply_shards_a_meta_model_over_a_fake_group(case):
    """Placements and local shapes after apply_tensor_parallel, rank 0 of a fake group of 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scaletune.strategies.parallel.tensor import apply_tensor_parallel

    model = tiny(tie_word_embeddings=case == "tied")
    if case == "lora":
        model = with_lora(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tensor",)))
    finally:
        dist.destroy_process_group()
    hf = model.get_base_model() if case == "lora" else model
    layer = hf.model.layers[0]
    q, o = layer.self_attn.q_proj, layer.self_attn.o_proj
    if case == "lora":
        assert q.base_layer.weight.placements == (Shard(0),) and q.base_layer.weight.to_local().shape == (32, 64)
        assert q.lora_B["default"].weight.placements == (Shard(0),)
        assert not isinstance(q.lora_A["default"].weight, DTensor)
        assert o.base_layer.weight.placements == (Shard(1),)
        assert o.lora_A["default"].weight.placements == (Shard(1),)
        assert not isinstance(o.lora_B["default"].weight, DTensor)
    else:
        assert q.weight.placements == (Shard(0),) and q.weight.to_local().shape == (32, 64)
        assert o.weight.placements == (Shard(1),) and o.weight.to_local().shape == (64, 32)
    assert not isinstance(layer.input_layernorm.weight, DTensor)  # norms stay replicated
    assert hf.lm_head.weight.placements == (Shard(0),)
    embed = hf.model.embed_tokens.weight
    if case == "tied":
        assert hf.lm_head.weight is embed and embed.placements == (Shard(0),)
    else:
        assert not isinstance(embed, DTensor)

"""The planner on a device mesh (plan/mesh.py, plan/activations.py): rank 0's parameter shards
against torch's own DTensor tensor-parallel split followed by FSDP2 over a fake process group of
12 ranks (uneven chunks included, LoRA included); degrees of 1 against the plain fsdp entry; the
activation terms against the formulas of Korthikanti et al. 2022 and DeepSpeed-Ulysses written out
here; the recommendation for Llama-3-8B at 131,072 tokens; the doctor's mesh checks and
`config show`'s mesh line."""

from __future__ import annotations

import pytest

from scaletune.config import load_config
from scaletune.plan import GiB, model_shape, plan
from scaletune.plan.activations import activation_bytes
from scaletune.plan.mesh import TensorLayout, mesh_entry, mesh_shard_elements, recommend_mesh, tensor_local_shape
from scaletune.resolve import Mesh, decide
from tests.helpers import make_env

LLAMA8B = dict(h=4096, i=14336, layers=32, heads=32, kv=8, head_dim=128, vocab=128256)


def spec_for(
    name: str, world: int, *, memory_gib: float | None = None, model=None, data=None, training=None, dist=None
):
    cfg = load_config(
        None,
        data={
            "model": {"name_or_path": name, "dtype": "bfloat16", **(model or {})},
            "data": {"dummy": {}, "max_seq_length": 2048, **(data or {})},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, **(training or {})},
            "distributed": dist or {},
        },
    )
    gpus = world if memory_gib is not None else 0
    return decide(cfg, make_env(world, gpus=gpus, memory_gib=memory_gib))


def _torch_shards(spec, mesh: Mesh) -> dict[str, int]:
    """Control: rank 0's local elements of every parameter after the strategy's own tensor split
    (`apply_tensor_parallel`: torch's ColwiseParallel / RowwiseParallel from the model's plan) and
    FSDP2 (`shard_model`) on the flattened data_shard x context dimension, on the meta device over
    a fake process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scaletune.models import decoder_layer_classes
    from scaletune.plan import meta_model
    from scaletune.strategies.parallel.parallelize import shard_model
    from scaletune.strategies.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=mesh.world_size)
    try:
        model = meta_model(spec)
        names = ("pipeline", "data_shard", "context", "tensor")
        device_mesh = init_device_mesh("cpu", mesh.shape, mesh_dim_names=names)
        dc = device_mesh["data_shard", "context"]._flatten("data_context")
        apply_tensor_parallel(model, device_mesh["tensor"])
        shard_model(model, tuple(decoder_layer_classes(model)), mesh=dc)
        return {n: p.to_local().numel() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


LORA = {"lora": {"r": 8, "alpha": 16, "target_modules": "auto"}}


@pytest.mark.parametrize(
    ("preset", "model"),
    [("llama-tiny", {}), ("llama-tiny", LORA), ("qwen2-tiny", {}), ("olmo2-tiny", LORA)],
    ids=["llama", "llama-lora", "qwen2-tied-biases", "olmo2-gathered-qkv-lora"],
)
def test_shards_match_the_tensor_parallel_strategy_and_fsdp2(preset, model):
    mesh = Mesh(data_shard=3, context=2, tensor=2)  # dc = 6: uneven chunks of q (32 rows), k (16), down (64)
    spec = spec_for(preset, 12, model=model, dist={"tensor_parallel": 2, "context_parallel": 2})
    assert spec.mesh == mesh
    shape = model_shape(spec)
    control = _torch_shards(spec, mesh)
    layout = TensorLayout.of(_hf(preset))
    ours = {p.name: mesh_shard_elements(p, mesh, layout) for p in shape.params}
    assert ours == {n: control[n] for n in ours}  # tied: the one tensor, named once in the shape
    assert set(control) - set(ours) <= {"lm_head.weight", "base_model.model.lm_head.weight"}
    k_proj = next(n for n in control if ".layers.0.self_attn.k_proj." in n and "lora" not in n and "weight" in n)
    assert control[k_proj] == 3 * 64  # [32, 64] split 2 ways is 16 rows: ceil(16 / 6) = 3 on rank 0
    entry = mesh_entry(spec, shape, mesh)
    trainable = sum(control[p.name] for p in shape.params if p.trainable)
    frozen = sum(control[p.name] for p in shape.params if not p.trainable)
    n_tensors = sum(p.trainable for p in shape.params)
    assert entry.params == 4 * trainable + 2 * frozen  # fp32 masters, bf16 frozen base
    assert entry.grads == 4 * trainable
    assert entry.optimizer == 8 * trainable + 4 * n_tensors


def test_tensor_local_shapes():
    llama, qwen = TensorLayout.of(_hf("llama-3-8b")), TensorLayout.of(_hf("qwen2-tiny"))
    assert tensor_local_shape("model.layers.0.self_attn.q_proj.weight", (4096, 4096), 4, llama) == (1024, 4096)
    assert tensor_local_shape("model.layers.0.self_attn.q_proj.bias", (4096,), 4, llama) == (1024,)
    assert tensor_local_shape("model.layers.0.mlp.down_proj.weight", (4096, 14336), 4, llama) == (4096, 3584)
    assert tensor_local_shape("model.layers.0.mlp.down_proj.bias", (4096,), 4, llama) == (4096,)
    assert tensor_local_shape("lm_head.weight", (128256, 4096), 3, llama) == (42752, 4096)
    assert tensor_local_shape("model.embed_tokens.weight", (128256, 4096), 4, llama) == (128256, 4096)
    assert tensor_local_shape("model.norm.weight", (4096,), 4, llama) == (4096,)
    peft = "base_model.model.model.layers.0."
    assert tensor_local_shape(peft + "self_attn.v_proj.base_layer.weight", (1024, 4096), 2, llama) == (512, 4096)
    assert tensor_local_shape(peft + "self_attn.v_proj.lora_A.default.weight", (16, 4096), 2, llama) == (16, 4096)
    assert tensor_local_shape(peft + "self_attn.v_proj.lora_B.default.weight", (1024, 16), 2, llama) == (512, 16)
    assert tensor_local_shape(peft + "mlp.down_proj.lora_A.default.weight", (16, 14336), 2, llama) == (16, 7168)
    assert tensor_local_shape(peft + "mlp.down_proj.lora_B.default.weight", (4096, 16), 2, llama) == (4096, 16)
    assert tensor_local_shape("model.layers.0.self_attn.q_proj.weight", (5, 3), 2, llama) == (
        3,
        3,
    )  # torch.chunk's first
    assert tensor_local_shape("model.embed_tokens.weight", (1000, 64), 2, qwen) == (500, 64)  # tied: vocab-parallel
    assert llama.splits_heads and not TensorLayout.of(_hf("olmo2-tiny")).splits_heads  # OLMo-2 gathers q/k/v


@pytest.fixture(scope="module")
def llama8b():
    spec = spec_for("llama-3-8b", 8, memory_gib=80, data={"max_seq_length": 131072})
    return spec, model_shape(spec)


def test_degrees_of_one_are_the_fsdp_entry(llama8b):
    spec, shape = llama8b
    fsdp = plan(spec, world_size=8, shape=shape).get("fsdp")
    entry = mesh_entry(spec, shape, Mesh(data_shard=8))
    assert entry.per_rank_bytes == fsdp.per_rank_bytes
    assert entry.margin == fsdp.margin


def _layer_terms(s: int, b: int, c: int, t: int, *, eager: bool = False) -> int:
    """Korthikanti et al. 2022 section 4.2 (no sequence parallelism) for a bf16 Llama layer, with
    Ulysses' context split: the norms' inputs and outputs whole on every tensor rank, the
    projections' outputs (Q, K, V, attention output, gate, SiLU(gate), up, product) over t, the
    attention's per-head terms over t x c."""
    d = LLAMA8B
    tokens = s // c * b
    q, kv = d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    whole = tokens * (2 * d["h"] * 2 + 2 * d["h"] * 2)
    split = tokens * 2 * (2 * q + 2 * kv + 4 * d["i"]) // t
    attention = 2 * (d["heads"] // (t * c)) * s * s * b * 2 if eager else 4 * d["heads"] // t * tokens
    return whole + split + attention


@pytest.mark.parametrize(("c", "t"), [(1, 1), (2, 1), (8, 1), (2, 2), (1, 4)])
def test_activation_terms(llama8b, c, t):
    spec, shape = llama8b
    d, s = LLAMA8B, 131072
    tokens = s // c
    loss = 1024 * (d["vocab"] // t) * (2 + 12)
    edges = 2 * tokens * d["h"] * 2
    ckpt = d["layers"] * tokens * d["h"] * 2 + _layer_terms(s, 1, c, t) + loss + edges
    full = d["layers"] * _layer_terms(s, 1, c, t) + loss + edges
    kw = dict(tensor=t, context=c)
    assert activation_bytes(shape, spec, checkpointing=True, **kw) == ckpt
    assert activation_bytes(shape, spec, checkpointing=False, **kw) == full


def test_eager_scores_only_without_context_parallelism(llama8b):
    """`eager` keeps the a s^2 b softmax; under context parallelism attention always runs sdpa."""
    spec, shape = llama8b
    eager = spec_for("llama-3-8b", 8, memory_gib=80, model={"attn_implementation": "eager"})
    s = eager.batch.max_seq_length
    sdpa = spec_for("llama-3-8b", 8, memory_gib=80)
    for c in (1, 2, 4):
        got = activation_bytes(shape, eager, checkpointing=True, context=c) - activation_bytes(
            shape, sdpa, checkpointing=True, context=c
        )
        assert got == ((_layer_terms(s, 1, c, 1, eager=True) - _layer_terms(s, 1, c, 1)) if c == 1 else 0)
    assert _layer_terms(s, 1, 1, 1, eager=True) - _layer_terms(s, 1, 1, 1) == 2 * 32 * s * s * 2 - 4 * 32 * s


def test_gathered_heads_and_packed_mask(llama8b):
    spec, shape = llama8b
    s, d = 131072, LLAMA8B
    q, kv = d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    split = activation_bytes(shape, spec, checkpointing=True, tensor=4)
    whole_heads = activation_bytes(shape, spec, checkpointing=True, tensor=4, heads=1)
    assert whole_heads - split == s * 2 * (2 * q + 2 * kv) * 3 // 4 + 4 * d["heads"] * s * 3 // 4
    packed = spec_for("llama-3-8b", 8, memory_gib=80, data={"max_seq_length": s, "packing": True})
    for c in (1, 4):
        extra = activation_bytes(shape, packed, checkpointing=True, context=c)
        # one bool [1, 1, s, s], and the bf16 bias SDPA makes of it in the (one) recomputed layer
        assert extra - activation_bytes(shape, spec, checkpointing=True, context=c) == s * s * (1 + 2)
        # without checkpointing every layer keeps its own bias for its backward
        extra = activation_bytes(shape, packed, checkpointing=False, context=c)
        assert extra - activation_bytes(shape, spec, checkpointing=False, context=c) == s * s * (1 + 2 * d["layers"])


def _hf(name: str):
    from scaletune.models import load_config as hf_config

    return hf_config(load_config(None, data={"model": {"name_or_path": name}, "data": {"dummy": {}}}).model)


def test_recommends_the_smallest_context_degree(llama8b):
    spec, shape = llama8b
    mem = int(74.5 * GiB)  # 80 GB = 80e9 bytes
    choice = recommend_mesh(spec, shape, _hf("llama-3-8b"), world_size=8, gpus_per_node=8, gpu_memory_bytes=mem)
    assert choice.chosen is not None and choice.chosen.mesh == Mesh(data_shard=4, context=2)
    assert [c.mesh.context for c in choice.candidates] == [1, 2]
    assert choice.candidates[0].entry.total > mem >= choice.chosen.entry.total
    assert "context_parallel 2" in choice.reason
    small = int(10 * GiB)  # 16 ranks on 2 nodes of 8, too little memory for any mesh
    choice = recommend_mesh(spec, shape, _hf("llama-3-8b"), world_size=16, gpus_per_node=8, gpu_memory_bytes=small)
    assert choice.chosen is None and "no mesh" in choice.reason
    # 8 key-value heads: tensor x context above 8 leaves a rank less than one whole head
    ruled = [c for c in choice.candidates if c.entry is None]
    assert [(c.mesh.tensor, c.mesh.context) for c in ruled] == [(1, 16), (2, 8), (4, 4), (8, 2)]
    assert all("does not divide the attention heads" in c.ruled_out for c in ruled)
    assert max(c.mesh.tensor for c in choice.candidates) == 8  # a tensor group stays within a node


def test_configured_mesh_is_the_runs_entry(llama8b):
    spec = spec_for("llama-3-8b", 8, memory_gib=80, dist={"context_parallel": 4})
    p = plan(spec, gpu_memory_bytes=80 * GiB)
    assert p.mesh is not None and p.for_run(spec) is p.mesh and p.mesh.name == "fsdp dp2 cp4 tp1"
    assert p.to_json()["mesh"]["name"] == "fsdp dp2 cp4 tp1"
    plain = spec_for("llama-3-8b", 8, memory_gib=80)
    assert plan(plain, gpu_memory_bytes=80 * GiB).mesh is None
    # Pipeline 2 x data 4: rank 0 holds the first stage (16 of 32 layers and the embeddings) in 4
    # shards: its fp32 parameters, from the published shapes (every dim 0 divides by 4).
    piped = spec_for("llama-3-8b", 8, memory_gib=80, dist={"pipeline_parallel": 2})
    entry = plan(piped, gpu_memory_bytes=80 * GiB).mesh
    assert entry is not None and entry.name == "fsdp pp2 dp4 cp1 tp1"
    h, i, kv, v = LLAMA8B["h"], LLAMA8B["i"], LLAMA8B["kv"] * LLAMA8B["head_dim"], LLAMA8B["vocab"]
    layer = 2 * h * h + 2 * kv * h + 3 * h * i + 2 * h
    assert entry.params == 4 * (v * h + 16 * layer) // 4


def test_doctor_shows_the_models_mesh_rules():
    from scaletune.doctor import check_mesh, checks

    assert check_mesh(spec_for("llama-tiny", 4))[0].status == "OK"
    ok = check_mesh(spec_for("llama-tiny", 4, dist={"tensor_parallel": 2}))
    assert [c.status for c in ok] == ["OK"] and "tensor 2" in ok[0].message
    # llama-tiny: 4 heads, 2 key-value heads: tensor 4 does not divide the key-value heads
    bad = check_mesh(spec_for("llama-tiny", 4, dist={"tensor_parallel": 4}))
    assert [c.status for c in bad] == ["FAIL"] and "key-value heads (2)" in bad[0].message and bad[0].fatal
    config_rule = check_mesh(spec_for("llama-tiny", 3, dist={"tensor_parallel": 2}))
    assert any("does not divide world_size 3" in c.message for c in config_rule)
    listed = checks(spec_for("llama-tiny", 3, dist={"tensor_parallel": 2}))
    assert sum("does not divide world_size 3" in c.message for c in listed) == 1  # shown once


def test_config_show_prints_mesh_and_batch(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from scaletune.cli import app

    for var, value in {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(var, value)
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {name_or_path: llama-tiny}\ndata: {dummy: {}, max_seq_length: 128}\n"
        "training: {global_batch_size: 8, micro_batch_size: 1}\ndistributed: {context_parallel: 2, tensor_parallel: 2}\n"
    )
    res = CliRunner().invoke(app, ["config", "show", str(path)])
    assert res.exit_code == 0, res.output
    assert "# mesh: world_size 8 = data_shard 2 x context 2 x tensor 2" in res.stdout
    # 8 = 1 x 2 data-parallel ranks x 4 accumulation steps
    assert (
        "global_batch_size 8 = micro_batch_size 1 x data-parallel ranks 2 x gradient_accumulation_steps 4" in res.stdout
    )


def test_first_stage_holds_its_layers_and_the_embeddings():
    """Llama-3-8B's 32 layers over 3 stages: rank 0 holds layers 0-10 (the first 32 % 3 = 2 stages
    get 11) and the input embeddings, neither the final norm nor the head; its parameter elements
    are the embeddings' plus 11 layers', written out from the published shapes."""
    from scaletune.plan.mesh import first_stage

    spec = spec_for("llama-3-8b", 3)
    shape = model_shape(spec)
    held = first_stage(shape, 3)
    names = {p.name for p in held}
    assert any("embed_tokens" in n for n in names) and not any(
        "lm_head" in n or n.endswith("model.norm.weight") for n in names
    )
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in names if ".layers." in n} == set(range(11))
    h, i, kv, v = LLAMA8B["h"], LLAMA8B["i"], LLAMA8B["kv"] * LLAMA8B["head_dim"], LLAMA8B["vocab"]
    layer = 2 * h * h + 2 * kv * h + 3 * h * i + 2 * h
    assert sum(p.numel for p in held) == v * h + 11 * layer
    assert first_stage(shape, 1) == shape.params

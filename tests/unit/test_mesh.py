"""The device mesh decided from `distributed.tensor_parallel` / `context_parallel` /
`pipeline_parallel`: its coordinates against torch's own row-major rank layout, the batch arithmetic
counting data-parallel ranks only, which rank reads which rows, and every config and model rule
reported at once (exit 2 at the CLI: tests/e2e)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Olmo2Config

from scaletune.data.batching import data_rank
from scaletune.errors import ConfigError
from scaletune.resolve import Mesh, decide, resolve
from scaletune.resolve.mesh import model_mesh_problems
from tests.helpers import make_config, make_env


def cfg(tmp_path, **distributed):
    return make_config(
        "olmo2-tiny",
        tmp_path / "run",
        as_config=True,
        distributed={"strategy": "auto", "num_processes": None, **distributed},
    )


def test_coordinates_follow_torch_row_major_layout():
    """Control: torch's own layout of ranks over a (pipeline, data_shard, context, tensor) mesh is
    `arange(world).view(shape)`; every rank's coordinates index its own number there."""
    mesh = Mesh(pipeline=2, data_shard=3, context=2, tensor=2)
    grid = torch.arange(mesh.world_size).view(mesh.shape)
    for rank in range(mesh.world_size):
        c = mesh.coordinates(rank)
        assert int(grid[c["pipeline"], c["data_shard"], c["context"], c["tensor"]]) == rank
    assert mesh.describe() == "world_size 24 = pipeline 2 x data_shard 3 x context 2 x tensor 2"


def test_auto_becomes_fsdp_and_batch_counts_data_parallel_ranks(tmp_path):
    """World 4 with tensor 2: data_shard 2; global 8 = micro 2 x 2 data ranks x 2 accumulation
    (a world-size count would say 1), and the printed arithmetic says which ranks it counts."""
    spec = decide(cfg(tmp_path, tensor_parallel=2), make_env(4))
    assert spec.strategy == "fsdp" and "data_shard" in spec.reason
    assert spec.mesh == Mesh(data_shard=2, tensor=2)
    assert (spec.batch.world_size, spec.batch.gradient_accumulation_steps) == (2, 2)
    text = spec.batch.describe()
    assert "data-parallel ranks 2" in text and "world_size 4 = data_shard 2 x tensor 2" in text
    # Without a mesh the arithmetic reads as before.
    plain = decide(cfg(tmp_path), make_env(4))
    assert plain.batch.world_size == 4 and "x world_size 4 x" in plain.batch.describe()


def test_ranks_of_a_tensor_or_context_group_read_the_same_rows(tmp_path):
    """World 8, context 2 x tensor 2: ranks 0-3 read share 0 and 4-7 share 1 of 2."""
    spec = decide(cfg(tmp_path, tensor_parallel=2, context_parallel=2), make_env(8))
    shares = [data_rank(spec.batch, make_env(8, rank=r)) for r in range(8)]
    assert shares == [0, 0, 0, 0, 1, 1, 1, 1] and spec.batch.world_size == 2
    plain = decide(cfg(tmp_path), make_env(8))
    assert [data_rank(plain.batch, make_env(8, rank=r)) for r in range(8)] == list(range(8))


def test_every_config_problem_at_once(tmp_path):
    """ddp with tensor 3 on 4 ranks, LoRA-free pipeline 2, liger, max_seq_length 63 with context 2:
    one error naming each key."""
    bad = make_config(
        "olmo2-tiny",
        tmp_path / "run",
        as_config=True,
        model={"liger": True},
        data={"max_seq_length": 63},
        distributed={"strategy": "ddp", "num_processes": None, "tensor_parallel": 3, "context_parallel": 2},
    )
    with pytest.raises(ConfigError) as err:
        resolve(bad, make_env(4))
    text = "\n".join(err.value.problems)
    for needle in (
        "needs distributed.strategy fsdp",
        "does not divide world_size 4",
        "model.liger cannot be combined",
        "data.max_seq_length 63 is not divisible by distributed.context_parallel 2",
    ):
        assert needle in text, text


def test_packed_rows_under_context_parallelism_are_refused_above_the_stated_length(tmp_path):
    """Issue 38: the dense document mask of packed rows (and SDPA's bias from it) grows with the
    square of the length: above MAX_PACKED_CONTEXT_LENGTH packed rows under context parallelism are
    one clear refusal; unpacked rows (causal, no mask) of the same length pass, as packed ones at it."""
    from scaletune.resolve.mesh import MAX_PACKED_CONTEXT_LENGTH

    def problems(length: int, packing: bool) -> str:
        c = make_config(
            "llama-3.2-1b",
            tmp_path / "run",
            as_config=True,
            data={"train": None, "dummy": {}, "max_seq_length": length, "packing": packing},
            training={"micro_batch_size": 1, "global_batch_size": 2},
            distributed={"strategy": "fsdp", "num_processes": None, "context_parallel": 2},
        )
        try:
            resolve(c, make_env(4, gpus=4))
        except ConfigError as err:
            return "\n".join(err.problems)
        return ""

    too_long = problems(2 * MAX_PACKED_CONTEXT_LENGTH, packing=True)
    assert "data.max_seq_length 65536 with data.packing under distributed.context_parallel" in too_long, too_long
    assert "12 GiB per row" in too_long and "set data.packing: false" in too_long
    assert "document mask" not in problems(2 * MAX_PACKED_CONTEXT_LENGTH, packing=False)
    assert "document mask" not in problems(MAX_PACKED_CONTEXT_LENGTH, packing=True)


def test_pipeline_rules(tmp_path):
    """Pipeline 2 on 2 ranks (global 8, micro 2: 4 micro-batches a step) resolves; with 1 micro-batch
    a step (1F1B needs one per stage), with tensor 2, with activation offload: one error naming each."""
    spec = resolve(cfg(tmp_path, pipeline_parallel=2), make_env(2))
    assert spec.mesh == Mesh(pipeline=2) and spec.batch.gradient_accumulation_steps == 4
    bad = make_config(
        "olmo2-tiny",
        tmp_path / "run",
        as_config=True,
        model={"activation_offload": True},
        training={"global_batch_size": 4, "micro_batch_size": 2},
        distributed={"strategy": "fsdp", "num_processes": None, "pipeline_parallel": 2, "tensor_parallel": 2},
    )
    with pytest.raises(ConfigError) as err:
        resolve(bad, make_env(8))
    text = "\n".join(err.value.problems)
    for needle in (
        "needs at least 2 micro-batches per step on each rank (1F1B), but gradient_accumulation_steps is 1",
        "cannot be combined with tensor_parallel or context_parallel",
        "model.activation_offload cannot be combined with distributed.pipeline_parallel",
    ):
        assert needle in text, text


def test_pipeline_model_rules():
    """Pipeline 2: a 2-layer untied Llama passes; 3 layers, a tied head, a sliding window each fail."""
    untied = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    assert model_mesh_problems(Mesh(pipeline=2), LlamaConfig(num_hidden_layers=2, **untied)) == []
    odd = [p.message for p in model_mesh_problems(Mesh(pipeline=2), LlamaConfig(num_hidden_layers=3, **untied))]
    assert len(odd) == 1 and "does not divide the model's 3 layers" in odd[0]
    tied = LlamaConfig(num_hidden_layers=2, **{**untied, "tie_word_embeddings": True})
    assert any("tied to the input embeddings" in p.message for p in model_mesh_problems(Mesh(pipeline=2), tied))
    mistral = MistralConfig(num_hidden_layers=2, sliding_window=4096, **untied)
    assert any("sliding-window" in p.message for p in model_mesh_problems(Mesh(pipeline=2), mistral))


def test_model_rules():
    """Heads 4 / kv 2 / MLP 128 / 2 layers: tensor 4 fails on kv heads; context 2 after tensor 2
    leaves 1 kv head per rank (fails); sliding-window Mistral is refused under context, Gemma-2's
    soft-capped logits under tensor; a valid layout has no problem."""
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    assert model_mesh_problems(Mesh(data_shard=1, tensor=2), llama) == []
    assert model_mesh_problems(Mesh(context=2), llama) == []
    tp4 = [p.message for p in model_mesh_problems(Mesh(tensor=4), llama)]
    assert len(tp4) == 1 and "key-value heads (2)" in tp4[0]
    both = [p.message for p in model_mesh_problems(Mesh(context=2, tensor=2), llama)]
    assert len(both) == 1 and "key-value heads (1)" in both[0]
    mistral = MistralConfig(sliding_window=4096, num_attention_heads=4, num_key_value_heads=2)
    assert any("sliding-window" in p.message for p in model_mesh_problems(Mesh(context=2), mistral))
    assert model_mesh_problems(Mesh(context=2), Olmo2Config(num_attention_heads=4, num_key_value_heads=2)) == []
    capped = Gemma2Config(num_attention_heads=4, num_key_value_heads=2, final_logit_softcapping=30.0)
    assert any("soft-capping" in p.message for p in model_mesh_problems(Mesh(tensor=2), capped))


def test_olmo2_tiny_shape_refusals_name_key_and_counts():
    """The preflight's model-shape messages for the CLI's model, olmo2-tiny (4 heads, 2 key-value
    heads, MLP 256), each keyed to the degree that the config file locates: tensor 4 fails on the
    key-value heads alone; context 2 after tensor 2 leaves 2 heads and 1 key-value head a rank, and
    after tensor 4 one head and none (the CLI's one run: tests/e2e/test_mesh_cli.py)."""
    from scaletune.models import PRESETS

    olmo = PRESETS["olmo2-tiny"].config()

    def problems(mesh):
        return [(p.key, p.message) for p in model_mesh_problems(mesh, olmo)]

    assert problems(Mesh(data_shard=2, tensor=2)) == [] and problems(Mesh(context=2)) == []
    [(key, message)] = problems(Mesh(tensor=4))
    assert key == "distributed.tensor_parallel"
    assert message.startswith("distributed.tensor_parallel 4 does not divide the model's key-value heads (2)")
    [(key, message)] = problems(Mesh(context=2, tensor=2))
    assert key == "distributed.context_parallel"
    assert message.startswith(
        "distributed.context_parallel 2 does not divide the attention heads (2) and key-value heads (1)"
    )
    assert [m for _, m in problems(Mesh(context=2, tensor=4))] == [
        "distributed.tensor_parallel 4 does not divide the model's key-value heads (2)",
        "distributed.context_parallel 2 does not divide the attention heads (1) and key-value heads (0) each rank "
        "holds after tensor_parallel 4: the all-to-all exchange gives each rank whole heads",
    ]

"""A device mesh that cannot run is refused by `scaletune train` before any rank starts: exit 2,
one message naming every problem with its file:line, nothing written."""

from __future__ import annotations

from tests.e2e.test_train_cli import _bad
from tests.helpers import make_config


def test_every_mesh_problem_in_one_message(tiny_model_dir, tmp_path):
    """deepspeed with tensor 3 x context 2 on 4 ranks and max_seq_length 63: the strategy, the
    world size, the sequence length, each located in the file."""
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        data={"max_seq_length": 63},
        distributed={"strategy": "deepspeed", "num_processes": 4, "tensor_parallel": 3, "context_parallel": 2},
    )
    err = _bad(cfg, tmp_path)
    assert "needs distributed.strategy fsdp (or auto), not deepspeed zero_stage 2" in err
    assert "(6 ranks per model replica) does not divide world_size 4" in err
    assert "data.max_seq_length 63 is not divisible by distributed.context_parallel 2" in err
    assert "config.yaml:" in err  # located in the file


def test_model_shape_refused(tiny_model_dir, tmp_path):
    """olmo2-tiny has 4 attention heads and 2 key-value heads: tensor 4 cannot split the latter,
    and context 2 on top of tensor 2 leaves one key-value head a rank to exchange."""
    cfg = make_config(
        tiny_model_dir, tmp_path / "run", distributed={"strategy": "fsdp", "num_processes": 4, "tensor_parallel": 4}
    )
    err = _bad(cfg, tmp_path)
    assert "tensor_parallel 4 does not divide the model's key-value heads (2)" in err
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        distributed={"strategy": "fsdp", "num_processes": 4, "tensor_parallel": 2, "context_parallel": 2},
    )
    err = _bad(cfg, tmp_path)
    assert "context_parallel 2 does not divide the attention heads (2) and key-value heads (1)" in err

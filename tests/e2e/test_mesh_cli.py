"""A device mesh that cannot run is refused by `scaletune train` before any rank starts: exit 2,
one message naming every problem with its file:line, nothing written. One run per phase: the
config's rules, then (with a valid config) the model's shape; each rule is held in-process by
tests/unit/test_mesh.py."""

from __future__ import annotations

from tests.helpers import assert_located, assert_refused, make_config


def test_every_mesh_problem_in_one_message(tiny_model_dir, tmp_path):
    """deepspeed with tensor 3 x context 2 on 4 ranks and max_seq_length 63: the strategy, the
    world size, the sequence length, each located in the file."""
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        data={"max_seq_length": 63},
        distributed={"strategy": "deepspeed", "num_processes": 4, "tensor_parallel": 3, "context_parallel": 2},
    )
    err = assert_refused(cfg, tmp_path)
    config = tmp_path / "config.yaml"
    degrees = "tensor_parallel 3, context_parallel 2"
    assert "invalid config (3 problems)" in err, err  # the config alone: as `launch` and `plan` head it
    strategy = f"{degrees} needs distributed.strategy fsdp (or auto), not deepspeed zero_stage 2"
    assert_located(err, config, "  tensor_parallel: 3", strategy)
    assert_located(
        err, config, "  tensor_parallel: 3", f"{degrees} (6 ranks per model replica) does not divide world_size 4"
    )
    assert_located(
        err, config, "  max_seq_length: 63", "data.max_seq_length 63 is not divisible by distributed.context_parallel 2"
    )


def test_model_shape_refused(tiny_model_dir, tmp_path):
    """A valid config whose mesh the model's shape cannot take: olmo2-tiny has 4 attention heads and
    2 key-value heads; tensor 4 cannot split the latter, and context 2 on top of it leaves each rank
    one head and no key-value head to exchange (tensor 2 x context 2's one key-value head a rank:
    tests/unit/test_mesh.py)."""
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        distributed={"strategy": "fsdp", "num_processes": 8, "tensor_parallel": 4, "context_parallel": 2},
    )
    err = assert_refused(cfg, tmp_path)
    config = tmp_path / "config.yaml"
    assert "cannot start training (2 problems)" in err, err
    assert_located(
        err,
        config,
        "  tensor_parallel: 4",
        "distributed.tensor_parallel 4 does not divide the model's key-value heads (2)",
    )
    assert_located(
        err,
        config,
        "  context_parallel: 2",
        "distributed.context_parallel 2 does not divide the attention heads (1) and key-value heads (0)",
    )

"""`scaletune train` with objective distill refuses what cannot train, exit 2, nothing written
(issue 36): the config's rules in one call (no teacher, packed rows, on policy: answer data and an
engine fsdp cannot run; a second frozen model asked by another stage), each at its file:line; then, once the rules pass, a teacher whose tokenizer is not
the student's (the full OLMo-2 tokenizer against the tests' cut one), named with both sizes."""

from __future__ import annotations

from tests.helpers import assert_located, assert_refused, make_config


def test_no_teacher_and_packing_in_one_message_at_their_lines(tiny_model_dir, tmp_path):
    """And, on policy: answer data where prompts are sampled from, an engine fsdp cannot run."""
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        data={"packing": True},
        training={"objective": "distill", "max_steps": 2, "distill": {"mode": "on_policy"}},
        distributed={"strategy": "fsdp", "num_processes": 2, "tensor_parallel": 2},
    )
    err = assert_refused(cfg, tmp_path)
    config = tmp_path / "config.yaml"
    assert_located(err, config, "  packing: true", "data.packing cannot be used with training.objective distill")
    assert "training.distill.teacher is not set: distillation trains the model towards a teacher's predictions" in err
    assert (
        "data.train.format is alpaca, but training.objective distill with distill.mode on_policy trains on prompt data"
        in err
    )
    assert "training.distill.engine hf generates with the trained module on each rank, which world_size 2" in err


def test_two_frozen_models_in_one_run_are_refused(tiny_model_dir, tiny_llama_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "run", training={"max_steps": 2})
    cfg["stages"] = [
        {"name": "a", "training": {"objective": "distill", "distill": {"teacher": str(tiny_model_dir)}}},
        {"name": "b", "training": {"objective": "distill", "distill": {"teacher": str(tiny_llama_dir)}}},
    ]
    err = assert_refused(cfg, tmp_path)
    assert "stages.0.training.distill.teacher: a run holds one frozen model beside the one it trains, but " in err
    assert "train them as two runs, the second from the first's final/" in err


def test_a_teacher_with_another_tokenizer_is_refused_before_training(tiny_model_dir, olmo2_vocab_model_dir, tmp_path):
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        training={"objective": "distill", "max_steps": 2, "distill": {"teacher": str(olmo2_vocab_model_dir)}},
    )
    err = assert_refused(cfg, tmp_path)
    assert f"training.distill.teacher {olmo2_vocab_model_dir} has another tokenizer than the model trained" in err, err
    assert "pick a teacher of the same model family" in err

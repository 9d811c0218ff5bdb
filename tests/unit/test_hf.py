"""scaletune.hf: TrainingArguments defaults and loading for users' own Trainer scripts."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch

from scaletune.errors import UserError
from scaletune.hf import load_model_for_training, training_arguments

LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def no_launcher(monkeypatch):
    for var in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "CROSS_RANK",
        "LOCAL_SIZE",
        "SLURM_PROCID",
        "SLURM_STEP_ID",
    ):
        monkeypatch.delenv(var, raising=False)


def test_training_arguments_defaults(tmp_path):
    from transformers import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated names used by default
        args = training_arguments(output_dir=str(tmp_path))
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}  # the alias mirrors it
    assert args.ddp_find_unused_parameters is False
    assert args.report_to == []  # "none"
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "save_safetensors" in fields:  # gone in transformers 5: safetensors is the only format
        assert args.save_safetensors is True


@pytest.mark.parametrize("cuda", [False, True], ids=["no-gpu", "gpu"])
def test_training_arguments_use_cpu_exactly_without_a_gpu(tmp_path, monkeypatch, cuda):
    """`use_cpu` is set where torch sees no CUDA device and left off where it sees one. The test
    decides what torch sees, so a default that ignores it (always or never CPU) fails one case."""
    from transformers import TrainingArguments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if cuda:  # its checks would reach for the GPU this machine may not have; the fields stay as given
        monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)
    args = training_arguments(output_dir=str(tmp_path))
    assert args.use_cpu is not cuda
    if not cuda:
        assert args.device.type == "cpu"


def test_training_arguments_overrides(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated names are translated
        args = training_arguments(
            output_dir=str(tmp_path),
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": True},
            ddp_find_unused_parameters=True,
            report_to="tensorboard",
            use_cpu=False,
            max_steps=7,
        )
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"use_reentrant": True}
    assert args.ddp_find_unused_parameters is True
    assert args.report_to == ["tensorboard"]
    assert args.use_cpu is False and args.max_steps == 7
    new = training_arguments(output_dir=str(tmp_path), activation_checkpointing_kwargs={"every_n_layers": 2})
    assert new.activation_checkpointing_kwargs == {"every_n_layers": 2}
    with pytest.raises(TypeError):
        training_arguments(output_dir=str(tmp_path), no_such_argument=1)


def test_load_model_for_training_with_lora(tiny_model_dir, no_launcher, caplog):
    import peft

    logging.getLogger("scaletune").addHandler(caplog.handler)
    try:
        model, tok = load_model_for_training(
            tiny_model_dir, lora={"r": 4, "alpha": 8, "dropout": 0.0}, gradient_checkpointing=True
        )
    finally:
        logging.getLogger("scaletune").removeHandler(caplog.handler)
    assert isinstance(model, peft.PeftModel)
    cfg = model.peft_config["default"]
    assert sorted(cfg.target_modules) == sorted(LLAMA_LIKE) and cfg.r == 4 and cfg.lora_alpha == 8
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(LLAMA_LIKE)
    base = model.get_base_model()
    assert base.is_activation_checkpointing and base.config.use_cache is False
    assert next(base.parameters()).dtype == torch.float32  # dtype None: the checkpoint's
    assert tok.pad_token == "<|pad|>" and tok.padding_side == "right"
    # device_map="auto" on this CPU machine: loaded on the CPU, and the log says why.
    assert "no CUDA device is visible" in caplog.text
    assert next(model.parameters()).device.type == "cpu"


def test_load_model_for_training_peft_config_and_dtype(tiny_model_dir, no_launcher):
    import peft

    model, _ = load_model_for_training(
        tiny_model_dir, lora=peft.LoraConfig(r=2, target_modules=["q_proj"]), dtype=torch.bfloat16, device_map=None
    )
    assert list(model.peft_config["default"].target_modules) == ["q_proj"]
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16


def test_load_model_for_training_sets_device_map_aside_under_a_launcher(tiny_model_dir, monkeypatch, caplog):
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(k, v)
    logging.getLogger("scaletune").addHandler(caplog.handler)
    try:
        model, _ = load_model_for_training(tiny_model_dir, device_map="auto")
    finally:
        logging.getLogger("scaletune").removeHandler(caplog.handler)
    assert "model.device_map=auto set aside" in caplog.text and "torchrun" in caplog.text
    assert not hasattr(model, "hf_device_map")


def test_load_model_for_training_errors(tiny_model_dir, tmp_path, no_launcher):
    with pytest.raises(UserError, match="no such file or folder"):
        load_model_for_training(tmp_path / "missing")
    with pytest.raises(UserError, match="lora.r"):
        load_model_for_training(tiny_model_dir, lora={"r": 0})
    with pytest.raises(UserError, match="model.device_map"):
        load_model_for_training(tiny_model_dir, device_map="everywhere")
    with pytest.raises(UserError, match="it needs lora"):
        load_model_for_training(tiny_model_dir, quantization={"bits": 4})
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        load_model_for_training(tiny_model_dir, quantization={"bits": 4}, lora={"r": 4})

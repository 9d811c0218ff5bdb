"""scaletune.models: presets, device placement under every launcher, loading, LoRA, checkpointing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from scaletune import models
from scaletune.config import LoraConfig, ModelConfig, QuantizationConfig
from scaletune.env import DistributedEnv
from scaletune.errors import UserError
from scaletune.models import (
    PRESETS,
    DevicePlacement,
    apply_lora,
    decoder_layer_classes,
    enable_gradient_checkpointing,
    init_model,
    load_model,
    load_tokenizer,
    lora_target_modules,
    max_positions,
    prepare_model,
    resolve_device_map,
)

CPU = DevicePlacement(None, "cpu")
LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_from_preset(name: str, **overrides):
    """A preset's architecture with a 256-token vocabulary: fast to build, same module names."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = {"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}
    return AutoModelForCausalLM.from_config(PRESETS[name].config(vocab_size=256, **ids, **overrides))


# ---------------------------------------------------------------------------------------------
# Presets and init_model


# (fixture, vocabulary rows, tokenizer length): the OLMo-2 tokenizer's 100,278 tokens padded to a
# multiple of 128, and the tests' cut of it to the 27,110 tokens of the project's data (tests/assets/README.md).
@pytest.mark.parametrize(
    ("fixture", "rows", "tokens"),
    [
        ("olmo2_vocab_model_dir", 100_352, 100_278),
        ("tiny_model_dir", 27_136, 27_110),
        ("tiny_llama_dir", 27_136, 27_110),
    ],
)
def test_fixture_presets_load_back_through_from_pretrained(fixture, rows, tokens, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = request.getfixturevalue(fixture)
    marker = json.loads((path / "scaletune_init.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == marker["parameters"]
    assert model.config.vocab_size == rows >= len(tok) == tokens
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert (path / "model.safetensors").is_file()
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize(
    ("preset", "model_type", "params"),
    [
        ("qwen2-tiny", "qwen2", 6_545_984),
        ("mistral-tiny", "mistral", 12_968_256),
        ("gpt-neox-tiny", "gpt_neox", 12_945_152),
    ],
)
def test_other_presets_build_and_load(tmp_path, preset, model_type, params):
    from transformers import AutoModelForCausalLM

    out = init_model(preset, tmp_path / preset, seed=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == model_type
    assert sum(p.numel() for p in model.parameters()) == params


def test_init_model_with_the_gpt_neox_tokenizer(tmp_path, shared_data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = init_model(
        "gpt-neox-tiny", tmp_path / "neox", tokenizer_file=shared_data / "tokenizers" / "gpt-neox-20b.json"
    )
    tok = AutoTokenizer.from_pretrained(out)
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert len(tok) == 50_280 and config.vocab_size == 50_304  # rounded up to a multiple of 128
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|padding|>")
    assert (config.eos_token_id, config.pad_token_id) == (0, 1)


def test_init_model_is_idempotent_and_refuses_to_clobber(tmp_path, olmo2_vocab_model_dir):
    weights = olmo2_vocab_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert init_model("olmo2-tiny", olmo2_vocab_model_dir, seed=0) == olmo2_vocab_model_dir
    assert weights.stat().st_mtime_ns == before
    with pytest.raises(UserError, match="different model"):
        init_model("olmo2-tiny", olmo2_vocab_model_dir, seed=1)
    with pytest.raises(UserError, match="different model"):
        init_model("llama-tiny", olmo2_vocab_model_dir)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        init_model("olmo2-tiny", foreign)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_init_model_is_deterministic(tmp_path, olmo2_vocab_model_dir):
    from safetensors.torch import load_file

    again = init_model("olmo2-tiny", tmp_path / "again", seed=0)
    a, b = load_file(olmo2_vocab_model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_preset_lists_the_presets(tmp_path):
    with pytest.raises(UserError) as err:
        init_model("olmo3-huge", tmp_path / "x")
    for name in PRESETS:
        assert name in str(err.value)
    assert not (tmp_path / "x").exists()


def test_large_presets_are_shapes_only(tmp_path):
    with pytest.raises(UserError, match="scaletune plan"):
        init_model("llama-3-8b", tmp_path / "big")
    assert not (tmp_path / "big").exists()


def test_cli_init_model_verb(tmp_path, olmo2_vocab_model_dir, capsys):
    from scaletune.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["init-model", "nope", "-o", str(tmp_path / "m")])
    assert exit_.value.code == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # click's standalone mode exits 0 on success
        main(["init-model", "olmo2-tiny", "-o", str(olmo2_vocab_model_dir)])  # idempotent: returns at once
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == str(olmo2_vocab_model_dir)


# ---------------------------------------------------------------------------------------------
# resolve_device_map under simulated launchers

TORCHRUN_2 = {
    "TORCHELASTIC_RUN_ID": "x",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
DEEPSPEED = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "CROSS_RANK": "0", "LOCAL_SIZE": "4"}


def env_of(environ: dict, *, gpus: int = 0) -> DistributedEnv:
    import dataclasses

    env = DistributedEnv.from_environ(environ, probe_cuda=False)
    return dataclasses.replace(env, cuda_available=gpus > 0, cuda_device_count=gpus)


@pytest.mark.parametrize(
    ("environ", "launcher"),
    [(TORCHRUN_2, "torchrun"), ({"RANK": "0"}, "env"), ({"LOCAL_RANK": "0"}, "env"), (DEEPSPEED, "deepspeed")],
    ids=["torchrun-world2", "RANK-only", "LOCAL_RANK-only", "deepspeed-launcher"],
)
@pytest.mark.parametrize("requested", ["auto", "sequential", "cuda:0"])
def test_device_map_is_set_aside_under_any_launcher(environ, launcher, requested):
    env = env_of(environ)
    assert env.launcher == launcher
    p = resolve_device_map(requested, env)
    assert (p.device_map, p.device) == (None, "cpu")
    assert f"model.device_map={requested} set aside" in p.message
    assert launcher in p.message
    assert "naive pipeline" in p.message and "each rank holds its own replica or shard" in p.message

    engine = resolve_device_map(requested, env, engine_places_model=True)
    assert (engine.device_map, engine.device) == (None, "cpu")
    assert "DeepSpeed" in engine.message


def test_device_map_values_are_the_schemas(monkeypatch):
    """One list of device_map values: the schema's. A value added there is accepted by the schema
    and by `resolve_device_map` alike (hf.py's path), and both refuse the same value the same way."""
    from scaletune.config import schema

    monkeypatch.setattr(schema, "DEVICE_MAPS", (*schema.DEVICE_MAPS, "balanced_high"))
    assert ModelConfig(name_or_path="x", device_map="balanced_high").device_map == "balanced_high"
    gpu = env_of({}, gpus=2)
    assert resolve_device_map("balanced_high", gpu).device_map == "balanced_high"
    with pytest.raises(ValueError, match="must be null, auto, .*balanced_high or cuda:N") as schema_error:
        ModelConfig(name_or_path="x", device_map="cuda:x")
    with pytest.raises(UserError) as placement_error:
        resolve_device_map("cuda:x", gpu)
    assert placement_error.value.problems[0].endswith(
        schema_error.value.errors()[0]["msg"].removeprefix("Value error, ")
    )


def test_device_map_under_a_launcher_goes_to_the_ranks_gpu():
    env = env_of(TORCHRUN_2, gpus=2)
    p = resolve_device_map("auto", env)
    assert (p.device_map, p.device) == (None, "cuda:1")
    assert "on this rank's device cuda:1" in p.message
    assert resolve_device_map(None, env) == DevicePlacement(None, "cuda:1")
    assert resolve_device_map("cuda:1", env) == DevicePlacement(None, "cuda:1")  # what it would get anyway
    assert resolve_device_map("auto", env, engine_places_model=True).device == "cpu"


def test_device_map_single_process_on_this_cpu_machine():
    env = env_of({})
    assert not env.launched
    assert resolve_device_map(None, env) == DevicePlacement(None, "cpu")
    assert resolve_device_map("cpu", env) == DevicePlacement(None, "cpu")
    auto = resolve_device_map("auto", env)
    assert (auto.device_map, auto.device) == (None, "cpu")
    assert "no CUDA device" in auto.message
    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_device_map("cuda:0", env)


def test_device_map_single_process_with_gpus():
    env = env_of({}, gpus=2)
    auto = resolve_device_map("auto", env)
    assert (auto.device_map, auto.device) == ("auto", "cuda:0")
    assert "split over 2 GPUs" in auto.message
    assert resolve_device_map("balanced", env_of({}, gpus=1)) == DevicePlacement("balanced", "cuda:0")
    assert resolve_device_map("cuda:1", env) == DevicePlacement({"": "cuda:1"}, "cuda:1")
    with pytest.raises(RuntimeError, match="only 2 CUDA device"):
        resolve_device_map("cuda:2", env)
    with pytest.raises(UserError):
        resolve_device_map("tpu", env)


def test_device_map_reads_the_real_environment(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    p = resolve_device_map("auto", DistributedEnv.from_environ())
    assert p.device == "cpu" and "set aside" in p.message


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_model_and_tokenizer(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="bfloat16")
    model = load_model(cfg, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model, "hf_device_map")
    tok = load_tokenizer(cfg)
    assert tok.padding_side == "right" and tok.pad_token == "<|pad|>"
    auto = load_model(cfg.model_copy(update={"dtype": "auto"}), CPU)
    assert next(auto.parameters()).dtype == torch.float32  # the checkpoint's dtype


def test_load_tokenizer_pads_with_eos_when_it_has_no_pad(tmp_path, tiny_model_dir):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(models.OLMO2_TOKENIZER), eos_token="<|endoftext|>")
    tok.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir), tokenizer=str(tmp_path / "tok")))
    assert loaded.pad_token == "<|endoftext|>" and loaded.padding_side == "right"


def test_missing_local_path_is_never_sent_to_the_hub(tmp_path, monkeypatch):
    import transformers

    def boom(*a, **k):
        raise AssertionError("from_pretrained must not be called")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    for name in [str(tmp_path / "nowhere"), "./runs/x/final", "../models/olmo", "~/no/such/model", "a/b/c"]:
        cfg = ModelConfig(name_or_path=name)
        with pytest.raises(UserError, match="no such file or folder") as err:
            load_model(cfg, CPU)
        assert repr(name) in str(err.value)
        with pytest.raises(UserError, match="no such file or folder"):
            load_tokenizer(cfg)
        with pytest.raises(UserError, match="no such file or folder"):
            load_model(cfg, CPU, meta=True)


def test_folder_without_config_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_model(ModelConfig(name_or_path=str(tmp_path / "empty")), CPU)


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not a local folder, and loading it from the Hugging Face hub failed"):
        load_model(ModelConfig(name_or_path="scaletune-test/does-not-exist"), CPU)


def _custom_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose config asks for a custom class; importing its code writes a sentinel."""
    folder = tmp_path / "custom"
    folder.mkdir()
    sentinel = tmp_path / "custom-code-ran"
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "scaletune_custom",
                "architectures": ["CustomForCausalLM"],
                "auto_map": {
                    "AutoConfig": "modeling_custom.CustomConfig",
                    "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
                },
            }
        )
    )
    (folder / "modeling_custom.py").write_text(
        f"open({str(sentinel)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'scaletune_custom'\n"
    )
    return folder, sentinel


def test_trust_remote_code_stays_off(tmp_path, monkeypatch, tiny_model_dir):
    folder, sentinel = _custom_code_folder(tmp_path)
    cfg = ModelConfig(name_or_path=str(folder))
    assert cfg.trust_remote_code is False
    for meta in (False, True):
        with pytest.raises(UserError, match="trust_remote_code: true") as err:
            load_model(cfg, CPU, meta=meta)
        assert "auto_map" in str(err.value)
    assert not sentinel.exists(), "the checkpoint's code was executed"

    # And the flag is passed explicitly as False (None would make transformers prompt).
    import transformers

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_model(ModelConfig(name_or_path=str(tiny_model_dir)), CPU)
    assert seen["trust_remote_code"] is False


def test_quantization_without_a_gpu_is_a_clear_error(tiny_model_dir, monkeypatch):
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), lora=LoraConfig(), quantization=QuantizationConfig(bits=4))
    with pytest.raises(RuntimeError) as err:
        load_model(cfg, CPU)
    msg = str(err.value)
    assert "4-bit" in msg and "nf4" in msg and "needs a CUDA GPU" in msg
    assert "Drop model.quantization" in msg and "GPU machine" in msg
    assert "bitsandbytes" not in sys.modules


def test_quantization_without_bitsandbytes_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"pip install 'scaletune\[gpu\]'"):
        models.bnb_config(QuantizationConfig(bits=8))


def test_quantization_config_is_built_as_asked(monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: SimpleNamespace() if name == "bitsandbytes" else real(name, *a)
    )
    q = models.bnb_config(
        QuantizationConfig(
            bits=4, quant_type="fp4", double_quant=False, compute_dtype="float16", storage_dtype="bfloat16"
        )
    )
    assert q.load_in_4bit and not q.load_in_8bit
    assert (q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant) == ("fp4", False)
    assert (q.bnb_4bit_compute_dtype, q.bnb_4bit_quant_storage) == (torch.float16, torch.bfloat16)
    assert models.bnb_config(QuantizationConfig(bits=8)).load_in_8bit


def test_liger_without_a_gpu_fails_before_any_weight_is_read(tmp_path, tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    # A missing model would be a UserError from load_model: the RuntimeError shows the order.
    for name in (str(tmp_path / "no-such-model"), str(tiny_model_dir)):
        with pytest.raises(RuntimeError, match=r"model\.liger asks for Liger's Triton kernels, which need a CUDA GPU"):
            prepare_model(ModelConfig(name_or_path=name, liger=True), CPU)
    with pytest.raises(RuntimeError, match="need a CUDA GPU"):
        models.apply_liger_kernels(nn.Linear(2, 2))
    assert "liger_kernel" not in sys.modules


def test_liger_without_the_package_says_what_to_install(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine without liger-kernel
    with pytest.raises(RuntimeError, match=r"liger-kernel is not installed: pip install 'scaletune\[liger\]'"):
        models.require_liger()


# ---------------------------------------------------------------------------------------------
# Meta device


def test_meta_loading_allocates_nothing(tiny_model_dir):
    model = load_model(ModelConfig(name_or_path=str(tiny_model_dir), dtype="bfloat16"), CPU, meta=True)
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    # Untied embeddings and head of 27,136 x 64 each, and the two layers' 123,392.
    assert sum(p.numel() for p in model.parameters()) == 2 * 27_136 * 64 + 123_392 == 3_596_800
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("preset", "params"),
    [("llama-3.2-1b", 1_235_814_400), ("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496)],
)
def test_large_preset_shapes_on_meta(preset, params):
    model = load_model(ModelConfig(name_or_path=preset), CPU, meta=True)
    assert all(p.is_meta for p in model.parameters())
    # Unique parameters: llama-3.2-1b ties lm_head to the embeddings.
    assert sum(p.numel() for p in model.parameters()) == params
    assert lora_target_modules(model) == LLAMA_LIKE


def test_prepare_model_on_meta_with_lora():
    cfg = ModelConfig(name_or_path="llama-3-8b", lora=LoraConfig(r=8))
    model = prepare_model(cfg, CPU, meta=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.is_meta for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# LoRA, checkpointing, introspection


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("llama-tiny", LLAMA_LIKE),
        ("olmo2-tiny", LLAMA_LIKE),
        ("qwen2-tiny", LLAMA_LIKE),
        ("mistral-tiny", LLAMA_LIKE),
        ("gpt-neox-tiny", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
    ],
)
def test_lora_auto_targets_of_known_architectures(preset, expected):
    model = tiny_from_preset(preset)
    assert lora_target_modules(model) == expected
    peft_model = apply_lora(model, {"r": 4, "alpha": 8})
    wrapped = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(expected)
    assert "lm_head" not in {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}


def test_lora_auto_targets_of_an_unknown_architecture():
    from transformers import AutoModelForCausalLM, PhiConfig

    model = AutoModelForCausalLM.from_config(
        PhiConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    )
    assert lora_target_modules(model) == ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"]


def test_lora_accepts_all_three_forms():
    import peft

    model = tiny_from_preset("llama-tiny")
    a = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]))
    assert isinstance(a, peft.PeftModel)
    assert sorted(a.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    assert a.peft_config["default"].lora_alpha == 8 and a.peft_config["default"].task_type == "CAUSAL_LM"
    b = apply_lora(tiny_from_preset("llama-tiny"), peft.LoraConfig(r=4))  # no targets: ours, not peft's q/v
    assert sorted(b.peft_config["default"].target_modules) == sorted(LLAMA_LIKE)
    assert b.peft_config["default"].task_type == "CAUSAL_LM"
    with pytest.raises(UserError, match="lora.r"):
        apply_lora(tiny_from_preset("llama-tiny"), {"r": 0})


def test_gradient_checkpointing_is_non_reentrant_and_trains_lora():
    model = apply_lora(tiny_from_preset("olmo2-tiny"), {"r": 4, "alpha": 8, "dropout": 0.0})
    enable_gradient_checkpointing(model)
    base = model.get_base_model()
    layers = [m for m in base.modules() if type(m) in decoder_layer_classes(base)]
    assert len(layers) == 2
    for layer in layers:
        assert layer.gradient_checkpointing is True
        assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    assert base.config.use_cache is False

    model.train()
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_decoder_layer_classes():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer

    assert decoder_layer_classes(tiny_from_preset("olmo2-tiny")) == {Olmo2DecoderLayer}
    llama = tiny_from_preset("llama-tiny")
    assert decoder_layer_classes(llama) == {LlamaDecoderLayer}
    assert decoder_layer_classes(apply_lora(llama, {"r": 2})) == {LlamaDecoderLayer}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = nn.Linear(4, 4)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4)])
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

    assert decoder_layer_classes(Plain()) == {Block}


def test_max_positions():
    from transformers import GPT2Config

    model = tiny_from_preset("llama-tiny")
    assert max_positions(model) == max_positions(model.config) == 2048
    assert max_positions(apply_lora(model, {"r": 2})) == 2048
    assert max_positions(PRESETS["llama-3.2-1b"].config()) == 131_072
    assert max_positions(GPT2Config(n_positions=512)) == 512
    assert max_positions(object()) is None


def test_prepare_model_full_and_lora(tiny_model_dir, caplog):
    import logging

    import peft

    caplog.set_level(logging.INFO, logger="scaletune")  # what an entry point sets (env.configure_logging)
    logging.getLogger("scaletune").addHandler(caplog.handler)
    try:
        cfg = ModelConfig(
            name_or_path=str(tiny_model_dir),
            dtype="float32",
            lora=LoraConfig(r=4, alpha=8),
            gradient_checkpointing=True,
        )
        model = prepare_model(cfg, CPU)
        assert isinstance(model, peft.PeftModel)
        assert model.get_base_model().config.use_cache is False
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # r * (in + out) per projection, 2 layers: q,o 64x64; k,v 64x32; gate,up 64->256; down 256->64
        per_layer = 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 256) * 3)
        assert trainable == 2 * per_layer
        assert f"{trainable:,} trainable of" in caplog.text and "LoRA" in caplog.text

        full = prepare_model(cfg.model_copy(update={"lora": None, "gradient_checkpointing": False}), CPU)
        assert all(p.requires_grad for p in full.parameters())
        assert full.config.use_cache is True
    finally:
        logging.getLogger("scaletune").removeHandler(caplog.handler)


def test_dtype_names_map_to_torch_with_their_sizes():
    """`torch_dtype` gives torch's dtype of each name, whose element size is the planner's bytes."""
    from scaletune.models.loading import torch_dtype
    from scaletune.resolve import FLOAT_DTYPES

    for name, (size, _) in FLOAT_DTYPES.items():
        assert torch_dtype(name) is getattr(torch, name) and torch_dtype(name).itemsize == size
    assert torch_dtype("uint8") is torch.uint8
    with pytest.raises(ValueError, match="not a torch dtype"):
        torch_dtype("Tensor")


def test_one_dtype_name_map():
    """Dtype names are mapped (to torch, to bytes, to `bf16`-style names or back) in one table."""
    import re

    src = Path(models.__file__).parent.parent
    # A key of a mapping (after `{`, `,` or at a line's start), not a comparison's operand (`!= "bfloat16":`).
    pattern = re.compile(
        r'(?:^|[{,])\s*"(?:float32|bfloat16|float16)"\s*:|"\s*:\s*torch\.(?:float32|bfloat16|float16)\b'
        r'|"(?:bf16|fp16|fp32)"\s*:\s*"',
        re.MULTILINE,
    )
    found = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if pattern.search(p.read_text()))
    assert found == ["resolve/spec.py"]


def test_builtin_attention_names_are_ones_transformers_knows():
    """The names `train --check` accepts without importing transformers' model code
    (models/checks.py BUILTIN_ATTENTION) are ones transformers registers, and a name it does not
    know still goes to transformers and is refused with the list it knows."""
    import contextlib

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from scaletune.models.attention import CAUSAL_SDPA, causal_sdpa
    from scaletune.models.checks import BUILTIN_ATTENTION, attention_problem

    assert BUILTIN_ATTENTION <= {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
    assert all(attention_problem(name) is None for name in BUILTIN_ATTENTION)
    refused = attention_problem("sdpaa")
    assert refused is not None and "'sdpaa' is not one transformers knows" in refused and "sdpa" in refused
    # The loss's own name for mask-free rows is registered with transformers once a run has used it,
    # but a model loaded under it would lose its masks: it is not a value for the config.
    config = type("Config", (), {"_attn_implementation": "sdpa"})()
    with causal_sdpa(config):
        assert config._attn_implementation == CAUSAL_SDPA and CAUSAL_SDPA in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert config._attn_implementation == "sdpa"
    refused = attention_problem(CAUSAL_SDPA)
    assert refused is not None and f"{CAUSAL_SDPA!r} is not one transformers knows" in refused
    with contextlib.suppress(RuntimeError), causal_sdpa(config):  # an error inside still restores it
        raise RuntimeError
    assert config._attn_implementation == "sdpa"

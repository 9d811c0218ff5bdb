"""Model and tokenizer loading: presets, device placement, LoRA, quantization, checkpointing.

Everything that turns `model:` of the YAML into a `torch.nn.Module` lives here, and nothing here
knows about parallelism beyond :func:`resolve_device_map`, which decides where the weights go
given how the process was launched (DESIGN.md: model code never mentions parallelism; the
strategies wrap what this module returns).

* :data:`PRESETS` / :func:`init_model`: tiny randomly initialised models built from a
  `transformers` config and the bundled OLMo-2 tokenizer (no download), and the shapes of real
  models for the memory planner (config only, built on the meta device).
* :func:`resolve_device_map`: the one place where `model.device_map` is interpreted.
* :func:`load_tokenizer`, :func:`load_model`, :func:`prepare_model`: loading through
  `from_pretrained`, so a tiny local model exercises the same path as a hub checkpoint.
* :func:`require_liger`, :func:`apply_liger_kernels`: `model.liger` (Liger's Triton kernels, CUDA).
* :func:`lora_target_modules`, :func:`apply_lora`, :func:`enable_gradient_checkpointing`,
  :func:`decoder_layer_classes`, :func:`max_positions`: what the strategies and the planner ask.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from scaletune.config import LoraConfig, ModelConfig, QuantizationConfig
from scaletune.env import DistributedEnv, get_logger
from scaletune.errors import UserError

if TYPE_CHECKING:  # torch and transformers are imported lazily: `scaletune --help` stays fast
    import peft
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# A child of the "scaletune" logger, whose handler and rank-aware level (env.set_rank) it follows.
get_logger()
log = logging.getLogger("scaletune.models")

ASSETS = Path(__file__).resolve().parent / "assets"
OLMO2_TOKENIZER = ASSETS / "olmo2-dolma2.json"

# Special tokens of the bundled OLMo-2 (dolma2) tokenizer, as allenai/OLMo-2-1124-7B declares
# them: documents end with <|endoftext|> (id 100257), which also serves as BOS; <|pad|> is 100277.
_OLMO2_EOS_ID = 100257
_OLMO2_PAD_ID = 100277
# OLMo-2 pads its 100,278-token vocabulary to 100,352 (a multiple of 128) for matmul efficiency.
_TINY_VOCAB = 100_352
_TINY_CONTEXT = 2048
_MARKER = "scaletune_init.json"


# ---------------------------------------------------------------------------------------------
# Presets


@dataclass(frozen=True)
class Preset:
    """A named model shape.

    Attributes:
        name: the preset's name (`scaletune init-model NAME`).
        config_class: the `transformers` config class, by name (`Olmo2Config`).
        kwargs: its constructor arguments.
        description: one line for listings.
        tiny: True when :func:`init_model` may materialise it with random weights on a CPU;
            False for the shapes of real models, which exist for the planner (meta device only).
    """

    name: str
    config_class: str
    kwargs: Mapping[str, Any]
    description: str
    tiny: bool = True

    def config(self, **overrides: Any) -> PretrainedConfig:
        """A fresh `transformers` config of this preset (`overrides` replace constructor args)."""
        import transformers

        cls = getattr(transformers, self.config_class)
        return cls(**{**self.kwargs, **overrides})


def _tiny(**kw: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=_TINY_VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as every recent architecture uses
        max_position_embeddings=_TINY_CONTEXT,
        bos_token_id=_OLMO2_EOS_ID,
        eos_token_id=_OLMO2_EOS_ID,
        pad_token_id=_OLMO2_PAD_ID,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


_LLAMA3_VOCAB = 128_256
# Shapes from the published config.json of meta-llama/Llama-3.2-1B, Meta-Llama-3-8B and -70B.
_LLAMA3_ROPE = {"rope_type": "default", "rope_theta": 500_000.0}
_LLAMA32_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "olmo2-tiny",
            "Olmo2Config",
            _tiny(bos_token_id=None),  # OLMo-2 prepends no BOS
            "OLMo-2 architecture, 2 layers x 64 hidden, 13.0M parameters (12.8M of them the untied embeddings)",
        ),
        Preset(
            "llama-tiny",
            "LlamaConfig",
            _tiny(),
            "Llama architecture, 2 layers x 64 hidden, 13.0M parameters",
        ),
        Preset(
            "qwen2-tiny",
            "Qwen2Config",
            # Qwen2.5's small models tie the input and output embeddings: one tiny preset that
            # does lets checkpoint and export code meet tied weights.
            _tiny(tie_word_embeddings=True),
            "Qwen2 architecture (q/k/v biases, tied embeddings), 2 layers x 64 hidden, 6.5M parameters",
        ),
        Preset(
            "mistral-tiny",
            "MistralConfig",
            _tiny(sliding_window=None),
            "Mistral architecture, 2 layers x 64 hidden, 13.0M parameters",
        ),
        Preset(
            "gpt-neox-tiny",
            "GPTNeoXConfig",
            {
                k: v
                for k, v in _tiny().items()
                if k != "num_key_value_heads"  # GPT-NeoX has no grouped-query attention
            },
            "GPT-NeoX architecture (fused query_key_value), 2 layers x 64 hidden, 13.0M parameters",
        ),
        Preset(
            "llama-3.2-1b",
            "LlamaConfig",
            dict(
                vocab_size=_LLAMA3_VOCAB, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131_072,
                rope_parameters=_LLAMA32_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=128_000, eos_token_id=128_001,
            ),
            "shape of Llama-3.2-1B (1.24B parameters; planner only)",
            tiny=False,
        ),
        Preset(
            "llama-3-8b",
            "LlamaConfig",
            dict(
                vocab_size=_LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_parameters=_LLAMA3_ROPE, rms_norm_eps=1e-5, bos_token_id=128_000, eos_token_id=128_001,
            ),
            "shape of Meta-Llama-3-8B (8.03B parameters; planner only)",
            tiny=False,
        ),
        Preset(
            "llama-3-70b",
            "LlamaConfig",
            dict(
                vocab_size=_LLAMA3_VOCAB, hidden_size=8192, intermediate_size=28_672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                rope_parameters=_LLAMA3_ROPE, rms_norm_eps=1e-5, bos_token_id=128_000, eos_token_id=128_001,
            ),
            "shape of Meta-Llama-3-70B (70.6B parameters; planner only)",
            tiny=False,
        ),
    ]
}


def get_preset(name: str) -> Preset:
    """The preset called `name`.

    Raises:
        UserError: no such preset; the message lists them all.
    """
    try:
        return PRESETS[name]
    except KeyError:
        listing = "; ".join(f"{p.name} ({p.description})" for p in PRESETS.values())
        raise UserError(f"unknown model preset {name!r}; presets: {listing}", title="unknown preset") from None


def preset_config(name: str) -> PretrainedConfig:
    """The `transformers` config of a preset (for the planner: no weights involved)."""
    return get_preset(name).config()


def init_model(preset: str, output: str | Path, *, seed: int = 0, tokenizer_file: str | Path | None = None) -> Path:
    """Build a randomly initialised model from a tiny preset and save it with its tokenizer.

    The weights are drawn after `torch.manual_seed(seed)` by the architecture's own initialiser,
    saved as float32 safetensors with `save_pretrained`; the tokenizer (a `PreTrainedTokenizerFast`
    over the bundled OLMo-2 tokenizer, or over `tokenizer_file`) is saved beside it, so the
    folder loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`.

    Idempotent: when `output` already holds this preset built with this seed and tokenizer (a
    `scaletune_init.json` marker written last says so), it is returned as is. The folder is built
    under a temporary name and renamed into place, so ranks that call this at the same time
    neither see a half-written model nor fail.

    Args:
        preset: a name in :data:`PRESETS` whose `tiny` is True.
        output: the folder to create (its parent is created too).
        seed: seed of the random initialisation.
        tokenizer_file: a `tokenizers` JSON to use instead of the bundled OLMo-2 one (for example
            the GPT-NeoX tokenizer in ../shared/data); the vocabulary is then sized to it,
            rounded up to a multiple of 128.

    Returns:
        The absolute path of `output`.

    Raises:
        UserError: unknown preset; a planner-only preset (too large to materialise here);
            `output` holds something else (another preset or seed, or files that are not a
            scaletune-built model).
    """
    p = get_preset(preset)
    if not p.tiny:
        tiny = ", ".join(n for n, q in PRESETS.items() if q.tiny)
        raise UserError(
            f"preset {preset!r} is the shape of a real model ({p.description}); init_model builds "
            f"random weights of tiny presets only ({tiny}). Use it with `scaletune plan`, which "
            "needs no weights, or point model.name_or_path at the real checkpoint.",
            title="preset too large",
        )
    out = Path(output).expanduser().resolve()
    tok_path = Path(tokenizer_file).expanduser().resolve() if tokenizer_file else OLMO2_TOKENIZER
    if not tok_path.is_file():
        raise UserError(f"tokenizer file {str(tok_path)!r} does not exist", title="missing tokenizer")
    want = {"preset": p.name, "seed": seed, "tokenizer": tok_path.name}
    if _existing_matches(out, want):
        return out

    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer_from_file(tok_path, model_max_length=p.kwargs.get("max_position_embeddings"))
    overrides: dict[str, Any] = {}
    if tokenizer_file:
        overrides = {
            "vocab_size": -(-len(tokenizer) // 128) * 128,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        if p.kwargs.get("bos_token_id") is not None:
            overrides["bos_token_id"] = tokenizer.bos_token_id
    config = p.config(**overrides)
    if config.vocab_size < len(tokenizer):
        raise AssertionError(f"preset {p.name}: vocab_size {config.vocab_size} < tokenizer length {len(tokenizer)}")

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(t.numel() for t in model.parameters())

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # The marker is written last: its presence means the folder is complete.
        (tmp / _MARKER).write_text(json.dumps({**want, "parameters": n_params}, indent=2) + "\n")
        try:
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            os.rename(tmp, out)
        except OSError:
            # Another process renamed its copy into place first; it is the same model.
            if not _existing_matches(out, want):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(f"built {p.name} (seed {seed}, {n_params:,} parameters) in {out}")
    return out


def _existing_matches(out: Path, want: dict[str, Any]) -> bool:
    """True when `out` holds the model `want` describes; False when `out` is absent or empty.

    Raises:
        UserError: `out` holds something else.
    """
    if not out.exists():
        return False
    if not out.is_dir():
        raise UserError(f"{out} exists and is not a folder", title="cannot write model")
    marker = out / _MARKER
    if marker.is_file():
        try:
            have = json.loads(marker.read_text())
        except (OSError, ValueError):
            have = {}
        if all(have.get(k) == v for k, v in want.items()):
            if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
                return True
        got = ", ".join(f"{k} {have.get(k)!r}" for k in want)
        asked = ", ".join(f"{k} {v!r}" for k, v in want.items())
        raise UserError(
            f"{out} already holds a different model ({got}); asked for {asked}. "
            "Choose another folder or delete this one.",
            title="cannot write model",
        )
    if any(out.iterdir()):
        raise UserError(
            f"{out} is not empty and was not written by init_model; choose an empty or new folder",
            title="cannot write model",
        )
    return False


def _tokenizer_from_file(path: Path, *, model_max_length: int | None = None) -> PreTrainedTokenizerBase:
    """A `PreTrainedTokenizerFast` over a `tokenizers` JSON with BOS/EOS/PAD found by name.

    EOS is the end-of-document token (`<|endoftext|>`, `</s>`, ...), BOS the same token where
    the vocabulary has no separate one (OLMo and GPT-NeoX do not), PAD a dedicated padding token
    where one exists, else EOS (labels of padding are masked, so the choice does not leak).
    """
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
    vocab = tok.get_vocab()

    def first(*names: str) -> str | None:
        return next((n for n in names if n in vocab), None)

    eos = first("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
    bos = first("<|begin_of_text|>", "<s>", "<bos>") or eos
    pad = first("<|pad|>", "<|padding|>", "<pad>", "<|finetune_right_pad_id|>") or eos
    if eos is None:
        raise UserError(f"tokenizer {path}: no end-of-text token found", title="invalid tokenizer")
    kwargs: dict[str, Any] = {"eos_token": eos, "bos_token": bos, "pad_token": pad}
    if model_max_length:
        kwargs["model_max_length"] = model_max_length
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path), **kwargs)
    tok.padding_side = "right"
    return tok


# ---------------------------------------------------------------------------------------------
# Device placement


@dataclass(frozen=True)
class DevicePlacement:
    """Where the model's weights go.

    Attributes:
        device_map: passed to `from_pretrained` (`"auto"`, `"sequential"`, `{"": "cuda:0"}`...),
            or None: load, then `.to(device)`.
        device: where the model (or, with a device_map, its inputs) lives: `"cpu"`, `"cuda:1"`.
        message: what was decided and why, when it differs from what was asked; :func:`load_model`
            logs it, callers need not.
    """

    device_map: str | dict[str, Any] | None
    device: str
    message: str | None = None


_SPLITTING_MAPS = ("auto", "sequential", "balanced", "balanced_low_0")


def resolve_device_map(
    requested: str | None, env: DistributedEnv, *, engine_places_model: bool = False
) -> DevicePlacement:
    """Decide where the model goes: THE one interpretation of `model.device_map`.

    Single process (`env.launched` is False): `auto` / `sequential` / `balanced` /
    `balanced_low_0` are passed to `from_pretrained` (accelerate splits the layers over the
    visible GPUs: naive pipeline parallelism, one GPU busy at a time; useful to fit a model that
    no single GPU holds), or resolve to the CPU with a message where no GPU is visible; `cuda:N`
    loads onto that GPU; `cpu` stays on the CPU; None means the process's device.

    Under any launcher (torchrun, the deepspeed launcher, srun, or RANK / LOCAL_RANK /
    WORLD_SIZE set by hand, even at world size 1) a requested device_map is set aside: DDP,
    FSDP and ZeRO give every rank its own replica or shard on its own GPU, while
    `device_map="auto"` would have each rank spread a whole model over every visible GPU,
    so that 8 ranks stack 8 copies on the same GPUs and the engines see parameters on devices
    they do not own. The model goes on the rank's device (`cuda:<local_rank>` or `cpu`), or
    stays on the CPU when `engine_places_model` (DeepSpeed moves it itself in `initialize`).

    Args:
        requested: `model.device_map` (None, `auto`, `sequential`, `balanced`,
            `balanced_low_0`, `cpu`, `cuda:N`).
        env: how the process was launched and which GPUs it sees.
        engine_places_model: the strategy moves the model itself (DeepSpeed).

    Returns:
        The :class:`DevicePlacement`.

    Raises:
        RuntimeError: `cuda:N` asked in a single process where no CUDA device (or no device N)
            is visible.
        UserError: `requested` is not one of the values above.
    """
    if requested is not None and requested not in _SPLITTING_MAPS + ("cpu",) and not re.fullmatch(r"cuda:\d+", requested):
        raise UserError(
            f"model.device_map {requested!r}: must be null, auto, sequential, balanced, balanced_low_0, cpu or cuda:N",
            title="invalid config",
        )
    rank_device = "cpu" if engine_places_model else str(env.device)

    if env.launched:
        if requested is None or requested == rank_device:
            return DevicePlacement(None, rank_device)
        where = (
            "on the CPU for the DeepSpeed engine to place"
            if engine_places_model
            else f"on this rank's device {rank_device}"
        )
        return DevicePlacement(
            None,
            rank_device,
            f"model.device_map={requested} set aside: this process was started by a distributed launcher "
            f"({env.launcher}, rank {env.rank} of {env.world_size}). device_map places one model across the "
            "visible devices within a single process (naive pipeline parallelism), which collides with "
            "DDP / FSDP / DeepSpeed ZeRO, where each rank holds its own replica or shard on its own GPU. "
            f"The model is loaded {where} instead. To split one model over several GPUs in one "
            "process, run without a launcher; to use every GPU for training, keep the launcher and "
            "drop device_map.",
        )

    # A single process from here on.
    if requested is None:
        return DevicePlacement(None, str(env.device))
    if requested == "cpu":
        return DevicePlacement(None, "cpu")
    if requested.startswith("cuda:"):
        index = int(requested[5:])
        if not env.cuda_available:
            raise RuntimeError(
                f"model.device_map={requested}, but there is no CUDA device: torch sees no GPU here "
                "(check CUDA_VISIBLE_DEVICES and the driver with `nvidia-smi`, or `scaletune doctor`). "
                "Set model.device_map to null or cpu to run on the CPU."
            )
        if index >= env.cuda_device_count:
            raise RuntimeError(
                f"model.device_map={requested}, but only {env.cuda_device_count} CUDA device(s) are "
                f"visible (cuda:0..cuda:{env.cuda_device_count - 1}); check CUDA_VISIBLE_DEVICES."
            )
        return DevicePlacement({"": requested}, requested)
    # auto / sequential / balanced / balanced_low_0
    if not env.cuda_available:
        return DevicePlacement(
            None,
            "cpu",
            f"model.device_map={requested}: no CUDA device is visible, so the model is loaded on the CPU.",
        )
    message = None
    if env.cuda_device_count > 1:
        message = (
            f"model.device_map={requested}: the model's layers are split over {env.cuda_device_count} GPUs in "
            "this one process (naive pipeline parallelism: one GPU computes at a time). To train with every "
            "GPU busy, drop device_map and set distributed.num_processes (DDP / FSDP / DeepSpeed)."
        )
    return DevicePlacement(requested, "cuda:0", message)


# ---------------------------------------------------------------------------------------------
# Loading

# A Hugging Face hub id: `name` or `owner/name`, letters, digits, `-`, `_`, `.`.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def _looks_local(name: str) -> bool:
    """True for strings that can only mean a local path (absolute, relative with ./ or ../, ~,
    more than one `/`, backslashes), which must not be sent to the hub when missing."""
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name in (".", "..")
        or not _HUB_ID.fullmatch(name)
        or ".." in name
        or "--" in name
    )


def _resolve_source(name: str, key: str, *, need_config: bool) -> str:
    """The path or hub id to hand to `from_pretrained`.

    Raises:
        UserError: a local-looking path that does not exist, or a folder without config.json.
    """
    p = Path(name).expanduser()
    if p.exists():
        if need_config and p.is_dir() and not (p / "config.json").is_file():
            raise UserError(
                f"{key} {name!r}: the folder has no config.json, so it is not a Hugging Face model folder",
                title="invalid model",
            )
        return str(p)
    if _looks_local(name):
        raise UserError(
            f"{key} {name!r}: no such file or folder (looked for {p.resolve()}). Build a tiny one with "
            "`scaletune init-model olmo2-tiny -o PATH`, or give a hub id like owner/name.",
            title="model not found",
        )
    return name


def _hub_failure(key: str, name: str, exc: Exception) -> UserError:
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    hint = (
        " The hub is switched off here (HF_HUB_OFFLINE): only models already in the cache can be used."
        if offline
        else " Check the id, `huggingface-cli login` for gated models, and the network."
    )
    return UserError(
        f"{key} {name!r}: not a local folder, and loading it from the Hugging Face hub failed: "
        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}.{hint}",
        title="model not found",
    )


def _remote_code_error(key: str, name: str, exc: Exception) -> UserError:
    return UserError(
        f"{key} {name!r} needs custom Python code from the model's files (config.json `auto_map`), "
        "which scaletune does not run unless asked. Read that code, then set "
        "model.trust_remote_code: true if you trust it.",
        title="remote code refused",
    )


def _is_remote_code_refusal(exc: Exception) -> bool:
    return "trust_remote_code" in str(exc)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of `cfg.tokenizer` (default: `cfg.name_or_path`).

    A tokenizer without a pad token gets its EOS token as pad (labels of padding positions are
    masked by the data layer, so this does not teach the model to stop early); padding is on
    the right, as causal-LM training with position ids from 0 expects.

    Raises:
        UserError: the path is missing, the tokenizer needs custom code that was not allowed,
            it cannot be loaded from the hub, or it has neither a pad nor an EOS token.
    """
    from transformers import AutoTokenizer

    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    name = cfg.tokenizer or cfg.name_or_path
    source = _resolve_source(name, key, need_config=False)
    try:
        tok = AutoTokenizer.from_pretrained(
            source, trust_remote_code=bool(cfg.trust_remote_code), revision=cfg.revision
        )
    except ValueError as exc:
        if _is_remote_code_refusal(exc):
            raise _remote_code_error(key, name, exc) from exc
        raise
    except OSError as exc:
        if source == name and not Path(name).exists():
            raise _hub_failure(key, name, exc) from exc
        raise UserError(f"{key} {name!r}: cannot load a tokenizer from it: {exc}", title="invalid tokenizer") from exc
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UserError(f"{key} {name!r}: the tokenizer has neither a pad nor an EOS token", title="invalid tokenizer")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def _torch_dtype(name: str) -> Any:
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def bnb_config(q: QuantizationConfig) -> Any:
    """The `transformers.BitsAndBytesConfig` for `model.quantization`, after checking the
    environment can run it.

    4-bit: NF4 or FP4 weights, optional double quantization (QLoRA, Dettmers et al. 2023),
    compute in `compute_dtype`, packed weights stored as `storage_dtype` (FSDP / ZeRO-3 flatten
    them with the other parameters, whose dtype it must equal). 8-bit: LLM.int8().

    Raises:
        RuntimeError: no CUDA GPU (checked before bitsandbytes is imported), or bitsandbytes is
            not installed.
    """
    import importlib.util

    import torch

    what = f"model.quantization asks for {q.bits}-bit bitsandbytes weights" + (
        f" ({q.quant_type})" if q.bits == 4 else ""
    )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what}, but bitsandbytes k-bit quantization needs a CUDA GPU and none is visible here. "
            "Drop model.quantization (train the LoRA adapter on unquantized weights) or run on a GPU machine."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(f"{what}, but bitsandbytes is not installed: pip install 'scaletune[gpu]'")
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, q.compute_dtype),
        bnb_4bit_quant_storage=getattr(torch, q.storage_dtype),
    )


def require_liger() -> None:
    """Check that this environment can run Liger's kernels (`model.liger`): a CUDA GPU first, then
    the liger-kernel package. liger_kernel is not imported here (it needs Triton).

    Raises:
        RuntimeError: no CUDA GPU is visible, or liger-kernel is not installed.
    """
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "model.liger asks for Liger's Triton kernels, which need a CUDA GPU, and none is visible "
            "here. Set model.liger: false (scaletune's chunked loss runs on any device) or run on a "
            "GPU machine."
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise RuntimeError("model.liger asks for Liger's kernels, but liger-kernel is not installed: pip install 'scaletune[liger]'")


def apply_liger_kernels(model: torch.nn.Module) -> bool:
    """Swap a loaded model's RMSNorm, rotary embedding and SwiGLU MLP for Liger's Triton kernels.

    Liger-Kernel (https://github.com/linkedin/Liger-Kernel) `_apply_liger_kernel_to_instance`
    from `liger_kernel.transformers.monkey_patch`, its entry point for an already instantiated
    model: it looks up the architecture's `apply_liger_kernel_to_*` by `config.model_type` and
    rebinds the `forward` of the existing norm and MLP modules, so parameters and state-dict keys
    are unchanged. Its cross-entropy patches are turned off: the
    loss is `loss.CausalLMLoss`'s (Liger's fused linear cross-entropy when `model.liger`), and the
    model's own forward keeps returning logits (evaluation, export, the Gemma-2 soft-cap path).

    Liger also rebinds names in the architecture's `transformers` modeling module (the rotary
    function, the norm and MLP classes), so models of that architecture built later in the same
    process get the kernels too.

    Args:
        model: the `transformers` causal LM (a peft or engine wrapper around it is unwrapped),
            before LoRA is applied.

    Returns:
        True when kernels were applied; False, with a warning, for an architecture Liger has no
        kernels for (the loss still uses Liger's).

    Raises:
        RuntimeError: no CUDA GPU, or liger-kernel is not installed (:func:`require_liger`).
    """
    require_liger()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    base = _unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        # Liger itself only logs this at INFO; say it where the user looks.
        log.warning(
            f"model.liger: Liger has no RMSNorm/RoPE/SwiGLU kernels for architecture {model_type!r} "
            f"(it has them for {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); only the loss uses Liger"
        )
        return False
    _apply_liger_kernel_to_instance(
        model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    log.info(f"model.liger: Liger's RMSNorm, RoPE and SwiGLU kernels applied to {type(base).__name__}")
    return True


def load_config(cfg: ModelConfig) -> PretrainedConfig:
    """The model's `transformers` config: from its folder or the hub, or a preset's by name.

    A preset name (`llama-3-8b`) is accepted where no such path exists, so the planner can work
    from a shape alone.

    Raises:
        UserError: missing path, custom code not allowed, hub failure.
    """
    from transformers import AutoConfig

    name = cfg.name_or_path
    if name in PRESETS and not Path(name).exists():
        return PRESETS[name].config()
    source = _resolve_source(name, "model.name_or_path", need_config=True)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=bool(cfg.trust_remote_code), revision=cfg.revision)
    except ValueError as exc:
        if _is_remote_code_refusal(exc):
            raise _remote_code_error("model.name_or_path", name, exc) from exc
        raise
    except OSError as exc:
        if source == name and not Path(name).exists():
            raise _hub_failure("model.name_or_path", name, exc) from exc
        raise


def load_model(cfg: ModelConfig, placement: DevicePlacement, *, meta: bool = False) -> torch.nn.Module:
    """Load the causal LM of `cfg` through `AutoModelForCausalLM.from_pretrained`.

    `dtype` (float32 / bfloat16 / float16 / auto: the checkpoint's), `attn_implementation`,
    `revision` and `trust_remote_code` (passed as given, False by default: custom code in a
    checkpoint is never run unless the config says so) come from `cfg`; `device_map` from
    `placement`. Without a device_map the model is moved to `placement.device`; a CUDA device
    is passed as `device_map={"": device}` so each rank streams the weights straight to its GPU
    rather than holding a full copy in host memory first.

    With `meta=True` the architecture is built from the config alone on the meta device (no
    weights read, no storage allocated): FSDP materialises it shard by shard and the planner
    counts its parameters. Quantization is ignored there (the planner accounts for it itself).

    Raises:
        UserError: missing local path (never sent to the hub), folder without config.json,
            custom code not allowed, hub failure.
        RuntimeError: quantization asked without a CUDA GPU or without bitsandbytes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if meta:
        return _meta_model(cfg)

    name = cfg.name_or_path
    source = _resolve_source(name, "model.name_or_path", need_config=True)
    kwargs: dict[str, Any] = {
        "dtype": _torch_dtype(cfg.dtype),
        "trust_remote_code": bool(cfg.trust_remote_code),
        "revision": cfg.revision,
    }
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    device_map = placement.device_map
    own_map = False
    if cfg.quantization is not None:
        kwargs["quantization_config"] = bnb_config(cfg.quantization)
        if device_map is None:
            # bitsandbytes quantizes while loading onto the GPU; a quantized model cannot be moved
            # with .to() afterwards, so it must be loaded where it will run.
            device = placement.device if placement.device.startswith("cuda") else f"cuda:{torch.cuda.current_device()}"
            device_map, own_map = {"": device}, True
    elif device_map is None and placement.device.startswith("cuda"):
        device_map, own_map = {"": placement.device}, True
    if device_map is not None:
        kwargs["device_map"] = device_map
    if placement.message:
        log.info(placement.message)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except ValueError as exc:
        if _is_remote_code_refusal(exc):
            raise _remote_code_error("model.name_or_path", name, exc) from exc
        raise
    except OSError as exc:
        if source == name and not Path(name).exists():
            raise _hub_failure("model.name_or_path", name, exc) from exc
        raise
    if device_map is None:
        model.to(placement.device)
    elif own_map and cfg.quantization is None and hasattr(model, "hf_device_map"):
        # A one-device map we added only to load straight onto the GPU: drop the attribute, or
        # HF Trainer / accelerate would treat the model as dispatched by a user's device_map.
        del model.hf_device_map
    return model


def _meta_model(cfg: ModelConfig) -> torch.nn.Module:
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(cfg)
    kwargs: dict[str, Any] = {"trust_remote_code": bool(cfg.trust_remote_code)}
    if cfg.dtype != "auto":
        kwargs["dtype"] = getattr(torch, cfg.dtype)
    elif getattr(config, "dtype", None) is None:
        kwargs["dtype"] = torch.float32
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, **kwargs)
        except (ImportError, ValueError) as exc:
            if "attn_implementation" not in kwargs or _is_remote_code_refusal(exc):
                raise
            # flash_attention_2 and friends check their kernels at construction; the shape does
            # not depend on them, so a planner on a machine without the kernel still works.
            log.info(f"attn_implementation {cfg.attn_implementation} unavailable here ({exc}); building with the default")
            kwargs.pop("attn_implementation")
            return AutoModelForCausalLM.from_config(config, **kwargs)


# ---------------------------------------------------------------------------------------------
# Introspection


def _unwrap(model: Any) -> Any:
    """The `transformers` model inside a PeftModel (or a DDP/FSDP-style `.module` wrapper)."""
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif hasattr(model, "module") and not hasattr(model, "config"):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner


def _config_of(model_or_config: Any) -> Any:
    cfg = getattr(_unwrap(model_or_config), "config", model_or_config)
    return cfg


def max_positions(model_or_config: Any) -> int | None:
    """The longest sequence (tokens) the model's position encoding was built for, from
    `max_position_embeddings` (or `n_positions`, `max_sequence_length`, `seq_length`, `n_ctx`),
    looking into `text_config` for multimodal configs; None when the config names none."""
    cfg = _config_of(model_or_config)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
            v = getattr(c, attr, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def decoder_layer_classes(model: Any) -> set[type]:
    """The transformer block classes of `model` (FSDP2 `fully_shard`s each instance).

    From the model's `_no_split_modules` (the class names `transformers` never splits across
    devices: exactly the blocks), resolved to classes by walking the modules; where that names
    nothing present, the class(es) of the elements of the largest `nn.ModuleList`.

    Raises:
        ValueError: the model has neither.
    """
    from torch import nn

    base = _unwrap(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(base).__name__}: no decoder layers found (no _no_split_modules, no ModuleList)")
    biggest = max(lists, key=len)
    return {type(m) for m in biggest}


# ---------------------------------------------------------------------------------------------
# LoRA and checkpointing

# The attention and MLP projections of each known architecture (`config.model_type`), as the
# QLoRA paper recommends (all linear layers of the blocks, not only q/v).
_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: dict[str, list[str]] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "olmo": _LLAMA_LIKE,
    "olmo2": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def lora_target_modules(model: Any) -> list[str]:
    """Module names for peft's `target_modules` when `model.lora.target_modules` is `auto`.

    Known architectures (:data:`LORA_TARGETS`, by `config.model_type`): their attention and MLP
    projections, keeping those present in the model. Otherwise every `nn.Linear` inside the
    decoder layers (:func:`decoder_layer_classes`), by leaf name, never the `lm_head`; a leaf
    name that also names a Linear outside the blocks is given by its full path instead, so peft's
    suffix matching cannot reach beyond the blocks.
    """
    from torch import nn

    base = _unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    linear_leaves = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    known = LORA_TARGETS.get(model_type or "")
    if known:
        present = [t for t in known if t in linear_leaves]
        if present:
            return present
    layer_types = tuple(decoder_layer_classes(base))
    inside: dict[str, list[str]] = {}
    outside: set[str] = set()
    block_prefixes = [n for n, m in base.named_modules() if isinstance(m, layer_types)]
    for n, m in base.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        leaf = n.rsplit(".", 1)[-1]
        if any(n.startswith(p + ".") for p in block_prefixes):
            inside.setdefault(leaf, []).append(n)
        else:
            outside.add(leaf)
    targets: list[str] = []
    for leaf, full in inside.items():
        targets.extend(full if leaf in outside else [leaf])
    log.info(
        f"LoRA target_modules auto: architecture {model_type!r} is not in the known list; "
        f"targeting every Linear of the decoder layers: {', '.join(targets)}"
    )
    return targets


def _to_peft_config(model: Any, lora: LoraConfig | Mapping | Any) -> Any:
    import peft
    from pydantic import ValidationError

    if isinstance(lora, peft.LoraConfig):
        cfg = lora
        changes: dict[str, Any] = {}
        if cfg.task_type is None:
            changes["task_type"] = peft.TaskType.CAUSAL_LM
        if cfg.target_modules is None:
            # peft's own default is q/v only for Llama and nothing for unknown architectures.
            changes["target_modules"] = lora_target_modules(model)
        if changes:
            import dataclasses

            cfg = dataclasses.replace(cfg, **changes)
        return cfg
    if isinstance(lora, Mapping):
        try:
            lora = LoraConfig.model_validate(dict(lora))
        except ValidationError as exc:
            raise UserError(
                [f"lora.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()],
                title="invalid LoRA config",
            ) from None
    if not isinstance(lora, LoraConfig):
        raise TypeError(f"lora must be a scaletune LoraConfig, a peft LoraConfig or a mapping, not {type(lora).__name__}")
    targets = lora_target_modules(model) if lora.target_modules == "auto" else list(lora.target_modules)
    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias=lora.bias,
        task_type=peft.TaskType.CAUSAL_LM,
    )


def is_quantized(model: Any) -> bool:
    """True for a bitsandbytes 4/8-bit model (or another `transformers` quantizer)."""
    base = _unwrap(model)
    return bool(
        getattr(base, "is_loaded_in_4bit", False)
        or getattr(base, "is_loaded_in_8bit", False)
        or getattr(base, "is_quantized", False)
        or getattr(base, "hf_quantizer", None) is not None
    )


def apply_lora(model: Any, lora: LoraConfig | Mapping | peft.LoraConfig) -> peft.PeftModel:
    """Wrap `model` in LoRA adapters with `peft.get_peft_model` (task CAUSAL_LM).

    `lora` is the YAML's `model.lora` (a :class:`~scaletune.config.LoraConfig` or the same
    mapping) or a `peft.LoraConfig`; `target_modules: auto` (or a peft config without targets)
    means :func:`lora_target_modules`. A quantized model first goes through
    `peft.prepare_model_for_kbit_training` (base frozen, norms upcast to float32), with its
    checkpointing left to :func:`enable_gradient_checkpointing`, which uses the non-reentrant
    variant that DDP accepts.

    Raises:
        UserError: an invalid LoRA mapping.
    """
    import peft

    peft_cfg = _to_peft_config(model, lora)
    if is_quantized(model):
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return peft.get_peft_model(model, peft_cfg)


def enable_gradient_checkpointing(model: Any, *, use_reentrant: bool = False) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of storing them.

    Uses PyTorch's non-reentrant checkpoint (`use_reentrant=False`) by default. The reentrant
    variant runs each layer's backward in a nested autograd call, so DDP's reducer sees the
    layer's parameters become ready from inside another backward, which fails with "Expected to
    mark a variable ready only once" whenever DDP searches for unused parameters (as HF Trainer
    does for a PeftModel); it also ignores keyword arguments and breaks with FSDP2. Sets
    `config.use_cache = False` (a KV cache is useless in training and conflicts with
    recomputation).

    Raises:
        ValueError: the architecture does not support checkpointing.
    """
    base = _unwrap(model)
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(base, "activation_checkpointing_enable"):
        # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias).
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if use_reentrant and hasattr(base, "enable_input_require_grads"):
        # Reentrant checkpointing is an autograd.Function that joins the backward graph only if one
        # of its tensor inputs requires grad. With LoRA the embeddings are frozen, so the hidden
        # states entering layer 0 do not, and the LoRA weights inside get no gradient at all; making
        # the embedding output require grad fixes that. Non-reentrant checkpointing records the
        # layer's own operations through saved-tensor hooks, so parameters inside receive gradients
        # whatever the inputs, and needs no such hook. (transformers >= 5 registers it anyway.)
        base.enable_input_require_grads()
    base.config.use_cache = False


def parameter_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit packed weights count as their unpacked size."""
    if hasattr(model, "get_nb_trainable_parameters"):
        return model.get_nb_trainable_parameters()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def compile_decoder_layers(model: Any) -> int:
    """`torch.compile` every decoder layer in place (`nn.Module.compile`); returns how many.

    Per block, as torchtitan does (`apply_compile`): each layer compiles once and the other layers
    reuse the graph; the model's own code around the blocks (embedding, mask building, head) stays
    eager, and FSDP2 can still `fully_shard` each compiled block. Compilation happens at the first
    forward; shapes that vary between batches (unpacked data) recompile once, then run dynamic.
    """
    classes = decoder_layer_classes(model)
    layers = [m for m in model.modules() if type(m) in classes]
    for layer in layers:
        layer.compile()
    log.info(f"torch.compile: {len(layers)} decoder layers (compiled at the first forward)")
    return len(layers)


def prepare_model(cfg: ModelConfig, placement: DevicePlacement, *, meta: bool = False) -> torch.nn.Module:
    """:func:`load_model`, then Liger's kernels (`cfg.liger`), then LoRA (`cfg.lora`), then
    gradient checkpointing (`cfg.gradient_checkpointing`), then `torch.compile` of the decoder
    layers (`cfg.compile`); logs the trainable and total parameter counts.

    Liger's environment (CUDA, liger-kernel) is checked before any weight is read. Its kernels
    go in before LoRA so that they patch the model's own modules (peft then wraps the Linear
    layers inside the patched MLPs); LoRA comes before checkpointing so that the checkpointed
    layers are the ones holding the adapters, and a quantized base is prepared for k-bit
    training before either.

    Raises:
        RuntimeError: `cfg.liger` without a CUDA GPU or without liger-kernel.
        what :func:`load_model` and :func:`apply_lora` raise.
    """
    if cfg.liger:
        require_liger()
    model = load_model(cfg, placement, meta=meta)
    if cfg.liger:
        apply_liger_kernels(model)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.compile:
        compile_decoder_layers(model)
    trainable, total = parameter_counts(model)
    kind = "LoRA" if cfg.lora is not None else "full fine-tuning"
    log.info(
        f"model {cfg.name_or_path}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / max(total, 1):.2f}%, {kind}{', meta device' if meta else ''})"
    )
    return model

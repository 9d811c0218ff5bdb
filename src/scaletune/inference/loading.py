"""What `chat`, `generate` and `eval` talk to: a run directory, a model folder, a LoRA adapter
(loaded on its base), a pretrained preset name or a hub id, with the prompt format it was trained
with."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from scaletune.config import Config, DataConfig, ModelConfig, load_config
from scaletune.errors import UserError

Template = Literal["chat", "alpaca", "none"]
TEMPLATES = ("auto", "chat", "alpaca", "none")


@dataclass
class Target:
    """Where a model is, before anything is loaded.

    Attributes:
        model_dir: the Hugging Face folder (a model, or a peft adapter), or None for a preset
            name or hub id given in `name`.
        name: what the user named (for messages).
        adapter: `model_dir` holds a peft adapter (`adapter_config.json`).
        run_config: the resolved config of the run that produced it (`config.yaml` of the run
            directory), or None.
        checkpoint: a `checkpoints/step-N` folder (then `model_dir` is None): loading exports it
            first (:func:`~scaletune.checkpoint.export_checkpoint`, the restricted loader).
    """

    model_dir: Path | None
    name: str
    adapter: bool
    run_config: Config | None
    checkpoint: Path | None = None


def find_target(target: str | Path) -> Target:
    """Interpret RUN_OR_MODEL: a run directory (its `final/`), a run's `final/`, a checkpoint
    (`checkpoints/step-N`: a folder with `progress.json`), another model or adapter folder, or (not a
    path) a pretrained preset name or hub id.

    Raises:
        UserError: a folder that is none of those (a run that has not finished: no `final/`; export
            or name one of its checkpoints).
    """
    name = str(target)
    p = Path(target).expanduser()
    if not p.exists():
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise UserError(f"{name}: no such run directory or model folder", title="model not found")
        return Target(None, name, False, None)
    if not p.is_dir():
        raise UserError(f"{name}: not a folder (give a run directory or a model folder)", title="invalid model")
    run_cfg = None
    if (p / "config.yaml").is_file() and (p / "progress.json").is_file() and not (p / "config.json").is_file():
        # A checkpoint: its config.yaml is the run's (as a run directory's), its weights are
        # exported to a Hugging Face folder when loaded.
        run_cfg = _run_config(p / "config.yaml")
        return Target(None, name, run_cfg.model.lora is not None, run_cfg, checkpoint=p)
    if (p / "config.yaml").is_file() and not (p / "config.json").is_file():
        run_cfg = _run_config(p / "config.yaml")
        if not (p / "final").is_dir():
            raise UserError(
                f"{name}: this run has no final/ model yet (it has not finished); name one of its "
                "checkpoints (RUN/checkpoints/step-N)",
                title="invalid model",
            )
        p = p / "final"
    elif (p.parent / "config.yaml").is_file():
        run_cfg = _run_config(p.parent / "config.yaml")
    adapter = (p / "adapter_config.json").is_file()
    if not adapter and not (p / "config.json").is_file():
        raise UserError(
            f"{name}: neither a run directory nor a Hugging Face model or adapter folder (no config.json "
            "or adapter_config.json)",
            title="invalid model",
        )
    return Target(p, name, adapter, run_cfg)


def _run_config(path: Path) -> Config:
    try:
        return load_config(path)
    except UserError as exc:
        raise UserError(
            [f"{path}: the run's config does not load: {p}" for p in exc.problems], title="invalid run"
        ) from None


def inference_dtype(requested: str, device: Any) -> str:
    """`auto`: bfloat16 on a GPU that supports it, else float32 (CPU matmuls are fastest in fp32)."""
    import torch

    if requested != "auto":
        return requested
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"


@dataclass
class LoadedModel:
    """A model ready to answer.

    Attributes:
        model: the causal LM in eval mode (a `peft.PeftModel` for an adapter).
        tokenizer: its tokenizer.
        template: how prompts are written: chat (the chat template), alpaca (Stanford Alpaca's
            prompt) or none (the text as it is).
        chat_template: the Jinja template for `chat` (the run's, else the tokenizer's, else ChatML).
        data: the run's `data` section (format, template, max_seq_length), or None.
        description: one line naming what was loaded and how prompts are written.
    """

    model: Any
    tokenizer: Any
    template: Template
    chat_template: str
    data: DataConfig | None
    description: str
    #: A vision-language model's processor (it renders prompts with images); None for a text model.
    processor: Any = None

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    @property
    def loaded(self) -> str:
        """The description without how prompts are written (for benchmarks, whose tasks write
        their own)."""
        return self.description.split(", prompts: ", 1)[0]


def trained_template(data: DataConfig | None, tokenizer: Any) -> Template:
    """The prompt format a run trained with: chat for `messages`, `preference` and `kto` data (always
    rendered with the chat template) or alpaca records with `template: chat`, alpaca for Stanford
    Alpaca prompts, none for plain text. Without a run: chat where the tokenizer has a chat
    template, else none."""
    if data is not None and data.train is not None and data.dummy is None:
        src = data.train
        if src.format in ("messages", "preference", "kto") or src.template == "chat":
            return "chat"
        return "alpaca" if src.format == "alpaca" else "none"
    return "chat" if isinstance(getattr(tokenizer, "chat_template", None), str) else "none"


def load_for_inference(
    target: str | Path,
    *,
    dtype: str = "auto",
    template: str = "auto",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load RUN_OR_MODEL (see :func:`find_target`) for generation or evaluation on this process's
    device (`cuda:0` where a GPU is visible, else the CPU).

    A LoRA adapter is loaded onto its base model: the run's `model` section where the adapter came
    from a run (same revision, attention, remote-code setting), else `base_model_name_or_path` of
    `adapter_config.json`. Custom code is never run unless `trust_remote_code` says so: a run
    directory's `config.yaml` is data (a downloaded run's `trust_remote_code: true` is not a
    permission); peft reads adapter weights from safetensors (or with `weights_only=True`).

    A checkpoint is exported first (in a temporary folder, removed once loaded), as `scaletune
    export` writes it: its weights read by the restricted loader (`safe_load`).

    Args:
        target: run directory, checkpoint, model or adapter folder, pretrained preset name or hub id.
        dtype: float32, bfloat16, float16 or auto (:func:`inference_dtype`).
        template: auto (as trained: :func:`trained_template`), chat, alpaca or none.
        trust_remote_code: allow the model folder's own Python code (config.json `auto_map`);
            the caller's choice alone (the command line's `--trust-remote-code`).

    Raises:
        UserError: see :func:`find_target`; a model or tokenizer that cannot be loaded; a checkpoint
            that cannot be exported (corrupt, unsafe, a factory model).
    """
    if template not in TEMPLATES:
        raise UserError(f"--template {template}: use one of {', '.join(TEMPLATES)}", title="invalid arguments")
    t = find_target(target)
    if t.checkpoint is not None:
        import tempfile

        from scaletune.checkpoint import export_checkpoint

        # The checkpoint as `scaletune export` writes it (an adapter stays an adapter, loaded on
        # its base below), in a folder that lives while the weights are read into memory.
        with tempfile.TemporaryDirectory(prefix="scaletune-checkpoint-") as tmp:
            folder = export_checkpoint(t.checkpoint, Path(tmp) / "model", trust_remote_code=trust_remote_code)
            exported = replace(t, model_dir=folder, checkpoint=None)
            return _load_target(exported, dtype, template, trust_remote_code)
    return _load_target(t, dtype, template, trust_remote_code)


def _load_target(t: Target, dtype: str, template: str, trust_remote_code: bool) -> LoadedModel:
    import torch

    from scaletune.env import DistributedEnv
    from scaletune.models import resolve_device_map

    env = DistributedEnv.from_environ(environ={})  # this process alone, whatever launched it
    dt = inference_dtype(dtype, torch.device(resolve_device_map(None, env).device))
    run_model = t.run_config.model if t.run_config is not None else None
    trust = trust_remote_code  # never the run's config.yaml: it came with the run, from whoever made it
    base_name = str(t.model_dir) if t.model_dir is not None else t.name
    if t.adapter:
        assert t.model_dir is not None
        base_name = run_model.name_or_path if run_model else _adapter_base(t.model_dir)
    if run_model is not None and t.adapter:
        model_cfg = run_model.model_copy(
            update={"dtype": dt, "lora": None, "device_map": None, "tokenizer": None, "trust_remote_code": trust}
        )
    else:
        attn = run_model.attn_implementation if run_model else "sdpa"
        model_cfg = ModelConfig(name_or_path=base_name, dtype=dt, attn_implementation=attn, trust_remote_code=trust)
    tok_dir = t.model_dir if t.model_dir is not None and (t.model_dir / "tokenizer_config.json").is_file() else None
    what = f"{t.name} (LoRA adapter on {base_name})" if t.adapter else t.name
    data = t.run_config.data if t.run_config is not None else None
    return load_model_config(
        model_cfg, data, adapter=t.model_dir if t.adapter else None, tokenizer=tok_dir, template=template, name=what
    )


def load_model_config(
    model_cfg: ModelConfig,
    data: DataConfig | None,
    *,
    adapter: Path | None = None,
    tokenizer: Path | None = None,
    template: str = "auto",
    name: str | None = None,
) -> LoadedModel:
    """Load the model a `model` section describes (its `lora` and `device_map` set aside), with a peft
    `adapter` folder on top and the tokenizer of `tokenizer` (default: the section's), for a run whose
    data section is `data` (None: no run). The trainer's samples load the base model this way.

    Raises:
        UserError: the model or tokenizer cannot be loaded.
    """
    from scaletune.data import resolve_chat_template
    from scaletune.env import DistributedEnv
    from scaletune.models import load_model, load_tokenizer, resolve_device_map
    from scaletune.models.checks import safetensors_problems
    from scaletune.models.loading import model_processor

    # The weights' headers against their files first: a stranger's folder fails here, by name,
    # rather than in the middle of loading.
    folders = [Path(model_cfg.name_or_path).expanduser(), *([adapter] if adapter is not None else [])]
    bad = [p for d in folders if d.is_dir() for f in sorted(d.glob("*.safetensors")) for p in safetensors_problems(f)]
    if bad:
        raise UserError(bad, title="invalid model")
    placement = resolve_device_map(None, DistributedEnv.from_environ(environ={}))
    cfg = model_cfg.model_copy(update={"lora": None, "device_map": None, "quantization": None})
    model = load_model(cfg, placement)
    if adapter is not None:
        import peft

        from scaletune.models.adapters import quiet_peft

        with quiet_peft():
            model = peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    model.eval()
    tok_cfg = cfg.model_copy(update={"tokenizer": str(tokenizer)}) if tokenizer else cfg
    processor = model_processor(tok_cfg)
    tok = processor.tokenizer if processor is not None else load_tokenizer(tok_cfg)
    if processor is not None and getattr(processor, "chat_template", None) and not tok.chat_template:
        tok.chat_template = processor.chat_template  # a vision-language folder's template is the processor's
    chosen: Template = trained_template(data, tok) if template == "auto" else template  # type: ignore[assignment]
    label = f"{name or cfg.name_or_path}, {cfg.dtype} on {placement.device}, prompts: {chosen}"
    return LoadedModel(model, tok, chosen, resolve_chat_template(data, tok), data, label, processor)


def _adapter_base(folder: Path) -> str:
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder}/adapter_config.json: cannot be read: {exc}", title="invalid model") from None
    if not base:
        raise UserError(
            f"{folder}/adapter_config.json names no base_model_name_or_path; cannot load the adapter",
            title="invalid model",
        )
    return str(base)

"""Typed configuration: pydantic models for the shape fixed in DESIGN.md, YAML loading with dotted
command-line overrides, and every problem reported at once with its file, line and key.

The derived numbers of a run (gradient accumulation, sequences and tokens per step) are computed
here and nowhere else: :func:`batch_arithmetic`.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scaletune.errors import ConfigError

Dtype = Literal["float32", "bfloat16", "float16", "auto"]


class _Strict(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Strict):
    """LoRA adapter (Hu et al. 2021, arXiv:2106.09685) applied through peft."""

    r: int = Field(16, ge=1)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: Literal["auto"] | list[str] = "auto"
    bias: Literal["none", "all", "lora_only"] = "none"


class QuantizationConfig(_Strict):
    """bitsandbytes quantization of the frozen base weights (QLoRA: Dettmers et al. 2023). Needs a GPU."""

    bits: Literal[4, 8]
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # FSDP and ZeRO-3 shard the 4-bit weights as flat tensors of this dtype; it must equal the
    # dtype of the other parameters they are flattened with.
    storage_dtype: Literal["uint8", "bfloat16", "float16", "float32"] = "uint8"


class ModelConfig(_Strict):
    name_or_path: str
    tokenizer: str | None = None  # defaults to name_or_path
    revision: str | None = None
    dtype: Dtype = "bfloat16"
    attn_implementation: str | None = "sdpa"
    trust_remote_code: bool = False
    device_map: str | None = None
    gradient_checkpointing: bool = True
    lora: LoraConfig | None = None
    quantization: QuantizationConfig | None = None
    # Keep the decoder's saved activations in host memory between forward and backward
    # (torch.autograd.graph.save_on_cpu): device memory for long sequences, paid in PCIe copies.
    activation_offload: bool = False
    # Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): CUDA and the
    # liger-kernel package (`pip install 'scaletune[liger]'`); not under DeepSpeed ZeRO-3.
    liger: bool = False
    # torch.compile each decoder layer (torchtitan's per-block compile, which FSDP2 then wraps).
    # Off by default: on the CPU it did not pay (docs/benchmarks.md); not under DeepSpeed ZeRO-3.
    compile: bool = False

    @field_validator("device_map")
    @classmethod
    def _device_map(cls, v: str | None) -> str | None:
        if v is None or v in ("auto", "sequential", "cpu", "balanced", "balanced_low_0"):
            return v
        if v.startswith("cuda:") and v[5:].isdigit():
            return v
        raise ValueError("must be null, auto, sequential, balanced, balanced_low_0, cpu or cuda:N")


class DataSource(_Strict):
    """One data set: a local JSON/JSONL file or a Hugging Face `datasets` name."""

    path: str
    format: Literal["alpaca", "messages", "text"] = "alpaca"
    split: str = "train"
    subset: str | None = None  # the `name` argument of datasets.load_dataset
    field: str | None = None  # column holding the record (text: default "text"; messages: "messages")
    max_samples: int | None = Field(None, ge=1)


class DummyData(_Strict):
    num_samples: int = Field(100, ge=1)
    seq_length: int | None = Field(None, ge=2)  # defaults to max_seq_length


class DataConfig(_Strict):
    train: DataSource | None = None
    eval: DataSource | None = None
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    max_seq_length: int = Field(1024, ge=8)
    packing: bool = False
    dummy: DummyData | None = None
    chat_template: str | None = None  # Jinja template; default: the tokenizer's, else a built-in one
    num_workers: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _sources(self) -> DataConfig:
        if self.train is None and self.dummy is None:
            raise ValueError("give data.train (a file or data set) or data.dummy")
        if self.eval is not None and self.eval_fraction is not None:
            raise ValueError("give data.eval or data.eval_fraction, not both")
        return self


class TrainingConfig(_Strict):
    global_batch_size: int = Field(32, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    epochs: float = Field(1, gt=0)
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float = Field(2.0e-4, ge=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    eval_every: int = Field(50, ge=0)
    save_every: int = Field(100, ge=0)
    log_every: int = Field(1, ge=1)
    keep_last: int = Field(2, ge=1)
    resume: str | None = None  # null | auto | a checkpoint path

    @model_validator(mode="after")
    def _batch(self) -> TrainingConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return self


class DistributedConfig(_Strict):
    strategy: Literal["auto", "single", "ddp", "fsdp", "deepspeed"] = "auto"
    num_processes: Literal["auto"] | int = "auto"
    zero_stage: int = Field(2, ge=1, le=3)
    offload_optimizer: bool = False
    offload_params: bool = False
    reshard_after_forward: bool = True  # FSDP2
    deepspeed_config: str | None = None  # a user's DeepSpeed JSON, merged with what the YAML implies
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_minutes: float = Field(30, gt=0)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("num_processes")
    @classmethod
    def _nproc(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be auto or a positive integer")
        return v


class StageTraining(_Strict):
    """The training fields a curriculum stage may override."""

    epochs: float | None = Field(None, gt=0)
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float | None = Field(None, ge=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] | None = None
    warmup_steps: int | None = Field(None, ge=0)
    min_lr_ratio: float | None = Field(None, ge=0, le=1)


class StageConfig(_Strict):
    name: str
    data: DataConfig | None = None  # default: the top-level data
    training: StageTraining | None = None
    continue_schedule: bool = False


class WandbConfig(_Strict):
    project: str
    entity: str | None = None
    name: str | None = None


class LoggingConfig(_Strict):
    tensorboard: bool = True
    wandb: WandbConfig | None = None


class Config(_Strict):
    output_dir: str = "runs/default"
    seed: int = 42
    overwrite: bool = False
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    stages: list[StageConfig] = Field(default_factory=list)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)


def cross_field_problems(data: dict) -> list[str]:
    """Problems that involve keys of more than one section, read from the raw mapping so they are
    reported even when other keys are invalid. Each names the keys involved."""

    def sec(name: str) -> dict:
        v = data.get(name)
        return v if isinstance(v, dict) else {}

    d, m, t = sec("distributed"), sec("model"), sec("training")
    strategy = d.get("strategy", "auto")
    off_opt, off_par = d.get("offload_optimizer") is True, d.get("offload_params") is True
    out = []
    if strategy in ("single", "ddp") and (off_opt or off_par):
        out.append(
            f"distributed.strategy {strategy} has no offload; use strategy deepspeed "
            "(offload_optimizer, offload_params) or fsdp (offload_params)"
        )
    if strategy == "fsdp" and off_opt:
        out.append(
            "distributed.offload_optimizer is DeepSpeed's; under fsdp set offload_params: true, "
            "which offloads parameters, gradients and optimizer state together"
        )
    if off_par and strategy == "deepspeed" and d.get("zero_stage", 2) != 3:
        out.append("distributed.offload_params needs zero_stage 3 (ZeRO-1/2 do not partition parameters)")
    q = m.get("quantization")
    if q is not None and m.get("lora") is None:
        out.append("model.quantization freezes the base weights: it needs model.lora (QLoRA)")
    shards_params = strategy == "fsdp" or (strategy == "deepspeed" and d.get("zero_stage", 2) == 3)
    if isinstance(q, dict) and shards_params:
        name = "fsdp" if strategy == "fsdp" else "deepspeed zero_stage 3"
        dtype = m.get("dtype", "bfloat16")
        if q.get("bits") == 8:
            out.append(
                f"model.quantization bits 8 cannot be sharded by {name}; use bits: 4 with "
                f"storage_dtype: {dtype}, or strategy ddp"
            )
        elif q.get("storage_dtype", "uint8") != dtype:
            # FSDP/ZeRO-3 flatten each unit's parameters into one tensor of one dtype; 4-bit weights
            # packed as uint8 cannot join the bf16 ones (QLoRA with FSDP, Answer.AI/HF 2024).
            out.append(
                f"model.quantization under {name} needs storage_dtype: {dtype} (equal to model.dtype, "
                "bitsandbytes' bnb_4bit_quant_storage) so the 4-bit weights shard with the other parameters"
            )
    if m.get("liger") is True and strategy == "deepspeed" and d.get("zero_stage", 2) == 3:
        # Liger's fused linear cross-entropy takes lm_head.weight as a tensor and multiplies it
        # outside lm_head's forward; ZeRO-3 gathers a partitioned weight only inside the forward
        # of the module that owns it, so there the weight is an empty placeholder.
        out.append(
            "model.liger cannot run under deepspeed zero_stage 3: Liger's fused linear cross-entropy "
            "reads lm_head.weight outside lm_head's forward, where ZeRO-3 keeps that weight partitioned "
            "(an empty placeholder); use zero_stage 1 or 2, strategy fsdp, or model.liger: false"
        )
    if m.get("compile") is True and strategy == "deepspeed" and d.get("zero_stage", 2) == 3:
        # ZeRO-3 gathers and releases each parameter from module hooks, which torch.compile
        # cannot trace through: every layer would break into eager pieces.
        out.append(
            "model.compile cannot run under deepspeed zero_stage 3 (its parameter-gathering hooks break "
            "the compiled graph); use zero_stage 1 or 2, strategy fsdp, or model.compile: false"
        )
    stages = data.get("stages") if isinstance(data.get("stages"), list) else []
    names = [s.get("name") for s in stages if isinstance(s, dict)]
    dupes = sorted({str(n) for n in names if n is not None and names.count(n) > 1})
    if dupes:
        out.append(f"stages: names must be unique, repeated: {', '.join(dupes)}")
    for i, st in enumerate(stages):
        overrides = st.get("training") if isinstance(st, dict) and isinstance(st.get("training"), dict) else {}
        clash = sorted(k for k in ("learning_rate", "lr_scheduler", "warmup_steps", "min_lr_ratio") if k in overrides)
        if isinstance(st, dict) and st.get("continue_schedule") is True and clash:
            out.append(
                f"stages[{i}] continues the running schedule (continue_schedule: true), so its "
                f"{', '.join(clash)} would be ignored; remove them or set continue_schedule: false"
            )
    resume = t.get("resume")
    if isinstance(resume, str) and not resume.strip():
        out.append("training.resume must be null, auto or a checkpoint path")
    return out


# ---------------------------------------------------------------------------------------------
# Derived numbers


@dataclass(frozen=True)
class BatchArithmetic:
    """How a global batch is split. `global_batch_size = micro_batch_size * world_size * grad_accum`."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    gradient_accumulation_steps: int
    max_seq_length: int

    @property
    def max_tokens_per_step(self) -> int:
        """Upper bound of tokens per optimizer step (all ranks): sequences x max_seq_length."""
        return self.global_batch_size * self.max_seq_length

    def describe(self) -> str:
        return (
            f"global_batch_size {self.global_batch_size} = micro_batch_size {self.micro_batch_size}"
            f" x world_size {self.world_size} x gradient_accumulation_steps "
            f"{self.gradient_accumulation_steps}; at most {self.max_tokens_per_step:,} tokens per step "
            f"(max_seq_length {self.max_seq_length})"
        )


def batch_arithmetic(training: TrainingConfig, world_size: int, max_seq_length: int) -> BatchArithmetic:
    """Split `global_batch_size` into micro-batches over `world_size` ranks.

    Raises:
        ConfigError: `global_batch_size` is not a multiple of `micro_batch_size * world_size`.
    """
    per_step = training.micro_batch_size * world_size
    if training.global_batch_size % per_step:
        lower = (training.global_batch_size // per_step) * per_step
        hint = f"{lower} or {lower + per_step}" if lower else f"{per_step}"
        raise ConfigError(
            f"training.global_batch_size ({training.global_batch_size}) must be a multiple of "
            f"micro_batch_size x world_size ({training.micro_batch_size} x {world_size} = {per_step}); "
            f"use for example {hint}"
        )
    return BatchArithmetic(
        global_batch_size=training.global_batch_size,
        micro_batch_size=training.micro_batch_size,
        world_size=world_size,
        gradient_accumulation_steps=training.global_batch_size // per_step,
        max_seq_length=max_seq_length,
    )


@dataclass(frozen=True)
class Stage:
    """One resolved curriculum stage: its data and the full training fields in force."""

    index: int
    name: str
    data: DataConfig
    training: TrainingConfig
    continue_schedule: bool


def resolve_stages(cfg: Config) -> list[Stage]:
    """The stages of a run; an empty `stages` list is one implicit stage named `main`."""
    if not cfg.stages:
        return [Stage(0, "main", cfg.data, cfg.training, False)]
    out = []
    for i, s in enumerate(cfg.stages):
        overrides = s.training.model_dump(exclude_none=True) if s.training else {}
        training = cfg.training.model_copy(update=overrides)
        if "max_steps" not in overrides and "epochs" in overrides:
            training = training.model_copy(update={"max_steps": None})
        out.append(Stage(i, s.name, s.data or cfg.data, training, s.continue_schedule))
    return out


# ---------------------------------------------------------------------------------------------
# Loading


def parse_override(item: str) -> tuple[list[str], Any]:
    """`training.learning_rate=1e-4` -> (["training", "learning_rate"], 1e-4). Values are YAML."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form key.path=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return parts, value


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def _key_lines(text: str) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line (list items by index)."""
    lines: dict[tuple, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                p = path + (k.value,)
                lines[p] = k.start_mark.line + 1
                walk(v, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[path + (i,)] = v.start_mark.line + 1
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed at `loc[:-1]`, walking the pydantic models."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return []
        cur = _inner_model(cur.model_fields[part].annotation)
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    for t in getattr(annotation, "__args__", ()) or (annotation,):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        inner = _inner_model(t) if getattr(t, "__args__", None) else None
        if inner is not None:
            return inner
    return annotation if isinstance(annotation, type) else None


def _format_errors(
    err: ValidationError, source: str, lines: dict[tuple, int], override_keys: set[tuple]
) -> list[str]:
    out = []
    for e in err.errors():
        # Drop the tagged-union / model_validator markers pydantic puts in `loc`.
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        key = ".".join(str(p) for p in loc) or "(top level)"
        where = source
        probe = loc
        while probe and probe not in lines:
            probe = probe[:-1]
        if loc in override_keys or any(loc[: len(k)] == k for k in override_keys):
            where = "command line"
        elif probe in lines:
            where = f"{source}:{lines[probe]}"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(Config, loc)
            near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            msg = f"unknown key{hint}; allowed here: {', '.join(allowed)}"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
        out.append(f"{where}: {key}: {msg}")
    return out


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *, data: dict | None = None) -> Config:
    """Read a YAML config (or a dict) and apply dotted overrides.

    Args:
        path: the YAML file; relative data and model paths in it stay relative to the working
            directory, as a user types them.
        overrides: `key.path=value` strings; values are parsed as YAML (`1e-4`, `true`, `[a, b]`).
        data: a mapping used instead of reading `path` (tests, the Python API).

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: listing every problem found, each with its file:line (or "command line") and key.
    """
    source = str(path) if path is not None else "<config>"
    problems: list[str] = []
    lines: dict[tuple, int] = {}
    if data is None:
        p = Path(path)  # type: ignore[arg-type]
        if not p.is_file():
            raise ConfigError(f"{source}: config file not found", title="invalid config")
        text = p.read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{source}:{mark.line + 1}" if mark else source
            raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}", title="invalid config")
        lines = _key_lines(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys", title="invalid config")
    data = _deepcopy(data)
    override_keys: set[tuple] = set()
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ValueError as exc:
            problems.append(f"command line: {exc}")
            continue
        _set_path(data, parts, value)
        override_keys.add(tuple(parts))
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        problems += _format_errors(exc, source, lines, override_keys)
        cfg = None
        # A model validator runs only once its own fields are valid; validate again with the
        # failing keys removed so those problems are reported now too, not after a fix.
        pruned = _without(data, [e["loc"] for e in exc.errors()])
        try:
            Config.model_validate(pruned)
        except ValidationError as again:
            problems += [p for p in _format_errors(again, source, lines, override_keys) if p not in problems]
    problems += [f"{source}: {p}" for p in cross_field_problems(data)]
    if problems:
        raise ConfigError(problems, title="invalid config")
    return cfg  # type: ignore[return-value]


def _without(data: dict, locs: list[tuple]) -> dict:
    """A copy of `data` with the keys at `locs` removed (defaults then apply)."""
    out = _deepcopy(data)
    for loc in locs:
        node: Any = out
        for part in loc[:-1]:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                node = None
                break
        if isinstance(node, dict) and loc and loc[-1] in node and len(loc) > 1:
            del node[loc[-1]]
    return out


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """True for environment variable names that usually hold credentials (HF_TOKEN, WANDB_API_KEY)."""
    return bool(_SECRET.search(name))


def redacted(cfg: Config) -> dict:
    """The config as plain data with secret-looking `distributed.env` values replaced."""
    data = cfg.model_dump(mode="json")
    env = data["distributed"]["env"]
    for k in env:
        if is_secret_name(k):
            env[k] = "<redacted>"
    return data


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML, every default filled in (written as `config.yaml`).

    Values of `distributed.env` whose names look like credentials are redacted.
    """
    return yaml.safe_dump(redacted(cfg), sort_keys=False, default_flow_style=False)


def steps_for(num_global_batches_per_epoch: int, training: TrainingConfig) -> int:
    """Optimizer steps of a stage: `max_steps` if set, else `ceil(epochs * batches per epoch)`."""
    if training.max_steps is not None:
        return training.max_steps
    return max(1, math.ceil(training.epochs * num_global_batches_per_epoch))

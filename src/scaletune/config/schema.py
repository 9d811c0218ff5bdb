"""The config's schema: one strict pydantic model per section, a docstring per field (meaning, unit,
default's source), from which `docs/config.md` is generated. Cross-field rules run in :mod:`scaletune.resolve`."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, create_model, field_validator, model_validator

from scaletune.config.distill import DistillConfig
from scaletune.config.distributed import DistributedConfig
from scaletune.config.preference import Objective, PreferenceConfig
from scaletune.config.rl import RLConfig
from scaletune.config.strict import StrictModel

Dtype = Literal["float32", "bfloat16", "float16", "auto"]
Scheduler = Literal["cosine", "linear", "constant"]
DEVICE_MAPS = ("auto", "sequential", "balanced", "balanced_low_0", "cpu")


def check_device_map(v: str | None) -> str | None:
    """Raises ValueError unless `v` is null, `cuda:N` or one of :data:`DEVICE_MAPS` (all but `cpu` split the layers)."""
    if v is not None and v not in DEVICE_MAPS and not re.fullmatch(r"cuda:\d+", v):
        raise ValueError(f"must be null, {', '.join(DEVICE_MAPS)} or cuda:N")
    return v


def _overrides(model: type[StrictModel], doc: str, keys: tuple[str, ...] | None = None) -> type[StrictModel]:
    """A stage's section: `model`'s fields (all, or `keys`), each optional with default None (not
    given: inherited), with `model`'s type, constraints and description (written once)."""
    fields: dict[str, Any] = {}
    for key, info in model.model_fields.items():
        if keys is None or key in keys:
            inner = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            fields[key] = (Optional[inner], Field(None, description=info.description))  # noqa: UP045
    return create_model(f"Stage{model.__name__[:-6]}", __base__=StrictModel, __doc__=doc, __module__=__name__, **fields)


class LoraConfig(StrictModel):
    """LoRA adapters (Hu et al. 2021, arXiv:2106.09685) injected by peft; the base weights freeze."""

    r: int = Field(16, ge=1)
    """Rank of each adapter's low-rank update (the A: d x r and B: r x k matrices)."""
    alpha: float = Field(32, gt=0)
    """Scaling numerator: the update is multiplied by alpha / r (peft's `lora_alpha`)."""
    dropout: float = Field(0.05, ge=0, lt=1)
    """Dropout probability on the adapter's input (peft's `lora_dropout`)."""
    target_modules: Literal["auto"] | list[str] = "auto"
    """Module names to adapt. `auto`: every attention and MLP projection of the decoder layers
    (the QLoRA paper's recommendation), never the output head."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train: none, all, or only those of adapted modules."""


class QuantizationConfig(StrictModel):
    """bitsandbytes quantization of the frozen base weights (QLoRA: Dettmers et al. 2023,
    arXiv:2305.14314). Needs `model.lora` and a CUDA GPU."""

    bits: Literal[4, 8]
    """4 (NF4/FP4, QLoRA) or 8 (LLM.int8())."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type: NormalFloat4 (the QLoRA paper's) or plain FP4."""
    double_quant: bool = True
    """Quantize the per-block absmax constants too (saves ~0.37 bits per parameter)."""
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype the 4-bit weights are dequantized to for each matmul."""
    storage_dtype: Literal["uint8", "bfloat16", "float16", "float32"] = "uint8"
    """dtype the packed 4-bit weights are stored as (bitsandbytes' `bnb_4bit_quant_storage`). FSDP and ZeRO-3 flatten
    each unit's parameters into one tensor of one dtype, so under them it must equal `model.dtype`."""


class ModelConfig(StrictModel):
    """The model to fine-tune and how to load and adapt it."""

    name_or_path: str | None = None
    """A local Hugging Face model folder, a hub id (owner/name), or, for `scaletune plan`, a preset name such as
    `llama-3-8b`. With `factory`: optional initial weights loaded over the factory's module, a `.safetensors` file or a
    folder holding `model.safetensors` (such as a run's `final/`); null keeps the factory's own weights."""
    factory: str | None = None
    """`package.module:callable` that builds your own `torch.nn.Module` (optionally with a tokenizer
    or processor) instead of `from_pretrained`; imported from your Python path, never read from a
    checkpoint. Contract: docs/custom-models.md."""
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the `factory` call (YAML values)."""
    shard_modules: list[str] | None = Field(None, min_length=1)
    """With `factory`: class names of the blocks FSDP2 shards as one unit each and DeepSpeed ZeRO-3
    gathers whole (its leaf modules). Default: the model's `shard_modules` attribute, else its
    `_no_split_modules`, else the elements of its largest `nn.ModuleList`."""
    tokenizer: str | None = None
    """Where the tokenizer is, when not beside the model (default: `name_or_path`)."""
    revision: str | None = None
    """Hub revision: a branch, tag or commit."""
    dtype: Dtype = "bfloat16"
    """Compute dtype of matmuls. Trainable weights stay float32 (master weights) and the forward runs
    under autocast or the engine's mixed precision; a frozen LoRA base is stored in this dtype.
    `auto`: bfloat16 on a GPU that supports it, else float32."""
    mixed_precision: Literal["autocast", "bf16_params"] = "autocast"
    """How single and ddp run a bfloat16 full fine-tune over float32 master weights. autocast: the fp32 weights compute
    under `torch.autocast`; the residual stream (embeddings, norms, adds) stays fp32. bf16_params: bf16 copies of the
    weights compute (FSDP2's `MixedPrecisionPolicy` on a replicate mesh, torchtitan's `mixed_precision_param`), and the
    gradients reduce and accumulate in fp32 for the fp32 masters that AdamW steps and checkpoints hold: a bf16 residual
    stream. Needs `dtype: bfloat16`, no LoRA. fsdp and deepspeed always cast their parameters (no change there)."""
    attn_implementation: str | None = "sdpa"
    """transformers' attention kernel: sdpa, eager, flash_attention_2, flex_attention, ... (null: the
    model's default)."""
    trust_remote_code: bool = False
    """Run Python code shipped in the model folder (config.json `auto_map`). Off unless you say so."""
    device_map: str | None = None
    """One process only: auto, sequential, balanced, balanced_low_0 (split the layers over the visible
    GPUs), cpu, or cuda:N. Set aside under a launcher, where each rank holds its own copy or shard."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute each decoder layer's activations in backward instead of keeping them (always
    non-reentrant, which DDP with LoRA needs). auto: the memory plan decides for the run's strategy,
    on only where the run does not fit this device's memory without it (recomputing costs about a
    fifth of a step); off without device memory to plan with (a CPU). The choice is printed at start."""
    lora: LoraConfig | None = None
    """LoRA adapters; null trains every weight (full fine-tuning)."""
    quantization: QuantizationConfig | None = None
    """k-bit frozen base weights (QLoRA); null keeps them in `dtype`."""
    activation_offload: bool = False
    """Keep the decoder's saved activations in host memory between forward and backward
    (torch.autograd.graph.save_on_cpu): less device memory for long sequences, paid in copies."""
    liger: bool = False
    """Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy). CUDA and
    `pip install 'scaletune[liger]'`; not with DeepSpeed ZeRO-3."""
    compile: bool = False
    """torch.compile each decoder layer (torchtitan's per-block compile). Not with DeepSpeed ZeRO-3."""

    @model_validator(mode="after")
    def _source(self) -> ModelConfig:
        if self.name_or_path is None and self.factory is None:
            raise ValueError("give model.name_or_path (a Hugging Face model) or model.factory (your own module)")
        return self

    _device_map = field_validator("device_map")(check_device_map)


class DataSource(StrictModel):
    """One data set: a local JSON/JSONL/Parquet/CSV file or folder, or a Hugging Face `datasets` name."""

    path: str | list[str]
    """The file, folder or data set name; or a list of local files of this format, read in order as one source."""
    format: Literal["alpaca", "messages", "text", "preference", "kto", "prompt"] = "alpaca"
    """alpaca: instruction/input/output records; messages: chat turns rendered with the chat template;
    text: plain text, all of it trained; preference: prompt/chosen/rejected pairs; kto:
    prompt/completion/label records (both rendered with the chat template; docs/preference.md);
    prompt: {prompt, ...fields} for online RL, the other fields handed to the reward functions
    (docs/rl.md)."""
    template: Literal["alpaca", "chat"] = "alpaca"
    """How alpaca records become text. alpaca: Stanford Alpaca's prompt (for base models); chat: a user
    turn (the instruction, then the input after a blank line) and an assistant turn (the output)
    rendered with the chat template, as `messages` data (for instruct models, which `scaletune chat`
    prompts the same way). Only the output is trained either way."""
    split: str = "train"
    """The split of a `datasets` name."""
    subset: str | None = None
    """The configuration name of a `datasets` name (`datasets.load_dataset(path, subset)`)."""
    field: str | None = None
    """Column holding the record (text: default `text`; messages: default `messages`)."""
    max_samples: int | None = Field(None, ge=1)
    """Read at most this many records (the first ones)."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("give a path, or a non-empty list of files")
        return v

    @model_validator(mode="after")
    def _template(self) -> DataSource:
        if self.template == "chat" and self.format != "alpaca":
            raise ValueError(f"template chat applies to format alpaca only (format {self.format} has its own)")
        return self


class DummyData(StrictModel):
    """Synthetic token sequences for smoke tests (replaces `data.train`)."""

    num_samples: int = Field(100, ge=1)
    """Sequences to generate."""
    seq_length: int | None = Field(None, ge=2)
    """Tokens per sequence (default: `data.max_seq_length`)."""


class DataConfig(StrictModel):
    """Training and evaluation data, tokenisation and packing."""

    train: DataSource | None = None
    """Training data."""
    eval: DataSource | None = None
    """Evaluation data: another source (or use `eval_fraction`)."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Hold out this fraction of the training records for evaluation (0 < f < 1)."""
    max_seq_length: int = Field(1024, ge=8)
    """Tokens per sequence; longer examples are truncated (examples left without a trained token are dropped)."""
    max_image_pixels: int = Field(89_478_485, ge=1)
    """Largest image (width x height) a vision-language model's records may hold; a larger one is refused from its
    header, before it is decoded (a decompression bomb). The default is Pillow's own `Image.MAX_IMAGE_PIXELS`."""
    packing: bool = False
    """Concatenate several examples per sequence, attention kept apart per example (no FLOPs spent on padding)."""
    dummy: DummyData | None = None
    """Synthetic data instead of `train`, for smoke tests."""
    chat_template: str | None = None
    """Jinja chat template for `messages` data (default: the tokenizer's, else ChatML)."""
    num_workers: int = Field(0, ge=0)
    """Worker processes for tokenisation and data loading (0: in the training process)."""
    factory: str | None = None
    """`package.module:callable` returning your own map-style dataset(s) and collator instead of
    `train` (batches may hold any tensors). Contract: docs/custom-models.md."""
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the data `factory` call (YAML values)."""

    @model_validator(mode="after")
    def _sources(self) -> DataConfig:
        if self.train is None and self.dummy is None and self.factory is None:
            raise ValueError("give data.train (a file or data set), data.factory or data.dummy")
        if self.eval is not None and self.eval_fraction is not None:
            raise ValueError("give data.eval or data.eval_fraction, not both")
        return self


class TrainingConfig(StrictModel):
    """The optimisation: batch, length of the run, AdamW, schedule, evaluation, checkpoints."""

    global_batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step, all ranks together. Must be a multiple of
    micro_batch_size x world_size; the quotient is the gradient accumulation."""
    micro_batch_size: int = Field(4, ge=1)
    """Sequences per rank per forward pass."""
    epochs: float = Field(1, gt=0)
    """Passes over the training data (fractions allowed); `max_steps` wins when set."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps of the run (or of a stage); takes precedence over `epochs`."""
    learning_rate: float = Field(2.0e-4, ge=0)
    """Peak learning rate of AdamW (after warmup)."""
    lr_scheduler: Scheduler = "cosine"
    """Decay after warmup: cosine (to `min_lr_ratio` x peak), linear (to 0) or constant."""
    warmup_steps: int = Field(10, ge=0)
    """Optimizer steps of linear warmup from 0 to `learning_rate`."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """cosine: the final learning rate as a fraction of the peak."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay (Loshchilov & Hutter 2019), on weights with 2+ dimensions only
    (not biases or norms, as GPT-2/nanoGPT/HF Trainer)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW's first-moment decay (torch's default)."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW's second-moment decay (torch's default)."""
    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW's denominator epsilon (torch's default)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm (L2, all ranks) to this; null: no clipping."""
    eval_every: int = Field(50, ge=0)
    """Evaluate every N optimizer steps and at the end of each stage; 0: only at stage ends."""
    eval_on_start: bool = False
    """Also evaluate before the first optimizer step: metrics.jsonl then opens with a step-0 `eval_loss`
    line, the untrained model's loss, so the curve starts at the baseline."""
    sample_prompts: list[str] = Field(default_factory=list)
    """Prompts the model answers before training and after it (greedy decoding, chat template where
    the data uses one); both answers go to `samples.md` and `samples.jsonl` in the run directory."""
    sample_max_new_tokens: int = Field(96, ge=1)
    """Longest answer to each of `sample_prompts`, in tokens."""
    save_every: int = Field(100, ge=0)
    """Write a resumable checkpoint every N optimizer steps; 0: only at stage ends."""
    log_every: int = Field(1, ge=1)
    """Write a metrics.jsonl line every N optimizer steps (and at every save and stage end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    objective: Objective = "sft"
    """The stage's loss: sft (next-token cross-entropy), a preference loss, dpo, ipo, orpo, kto or
    simpo (docs/preference.md), whose batch sizes count pairs (KTO: records), grpo, online RL
    (docs/rl.md), whose batch sizes count prompts, or distill, a teacher's distributions on SFT data
    (docs/distill.md)."""
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    """The preference loss's settings and its reference model."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """Online RL's settings (objective grpo): the group, sampling, the loss, rewards, the engine."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """Distillation's settings (objective distill): the teacher and the divergence."""
    resume: str | None = None
    """null: start fresh; auto: continue from the run directory's latest checkpoint (or start fresh);
    a path: a checkpoints/step-N folder or a run directory."""

    @property
    def sampling(self) -> RLConfig | DistillConfig | None:
        """The settings that sample completions of the data's prompts at every step (grpo's `rl`,
        on-policy distillation's `distill`); None where the objective trains on the data's rows."""
        if self.objective == "grpo":
            return self.rl
        if self.objective == "distill" and self.distill.mode == "on_policy":
            return self.distill
        return None


StageData = _overrides(
    DataConfig,
    """A stage's data: each key given replaces the top level's; the others are inherited (a stage
    that names only its `train` file keeps `max_seq_length`, `packing`...).""",
)
StageTraining = _overrides(
    TrainingConfig,
    """The training keys a stage may replace; `epochs` without `max_steps` clears an inherited `max_steps`.""",
    (
        "epochs",
        "max_steps",
        "learning_rate",
        "lr_scheduler",
        "warmup_steps",
        "min_lr_ratio",
        "objective",
        "preference",
        "rl",
        "distill",
    ),
)


class StageConfig(StrictModel):
    """One curriculum stage: its data and training keys are merged onto the top level's."""

    name: str
    """Unique name; every metrics.jsonl line carries it."""
    data: StageData | None = None  # type: ignore[valid-type]
    """Data keys this stage replaces."""
    training: StageTraining | None = None  # type: ignore[valid-type]
    """Training keys this stage replaces."""
    continue_schedule: bool = False
    """Extend the running learning-rate schedule instead of starting a new one."""
    trainable: list[str] | None = Field(None, min_length=1)
    """Glob patterns (fnmatch, `*` crosses dots) over parameter names as the model names them
    (`model.named_parameters()`): exactly the matching parameters train in this stage. null: the
    parameters that train by default (all; the adapters under LoRA). Each pattern must match. A vision-language
    model's groups are names too: `vision` (its vision tower), `projector`, `language` (the language model and its
    head; under LoRA, its adapters). Under LoRA, base weights a stage trains beside the adapters (the `projector`)
    are saved in the adapter folder as peft's `modules_to_save`, which peft loads over the base's."""
    frozen: list[str] | None = Field(None, min_length=1)
    """Glob patterns of parameters frozen in this stage, taken out of `trainable` (or of the default
    set). Each pattern must match. A tied tensor is frozen under whichever of its names a pattern
    names (the embeddings freeze a tied head). The optimizer is rebuilt when a stage trains another set."""


class WandbConfig(StrictModel):
    """Weights & Biases logging from rank 0 through the `wandb` package (`pip install
    'scaletune[wandb]'`). The API key comes from `wandb login` or WANDB_API_KEY, never from this
    file; the resolved config is sent with secret-looking values redacted."""

    project: str
    """W&B project."""
    entity: str | None = None
    """W&B team or user (default: your default entity)."""
    name: str | None = None
    """Run name (default: W&B's)."""
    group: str | None = None
    """Group runs together (e.g. the runs of one sweep)."""
    tags: list[str] = Field(default_factory=list)
    """Tags on the run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (files under `output_dir/wandb`, upload later with `wandb sync`) or disabled;
    null: WANDB_MODE, else online."""


class MlflowConfig(StrictModel):
    """MLflow tracking from rank 0 through the `mlflow` package (`pip install 'scaletune[mlflow]'`:
    mlflow-skinny). The run gets the resolved config's values as parameters (dotted names, secret
    `distributed.env` values redacted), every number of each metrics.jsonl line at its step (named
    as in TensorBoard: `train/loss`, `eval/loss`), its end status (FINISHED; KILLED when stopped on
    request; FAILED) and, at the end, config.yaml, metrics.jsonl and loss.png as artifacts, never a
    checkpoint. Credentials come from MLflow's own variables (MLFLOW_TRACKING_TOKEN,
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD), never from this file. A resumed run
    continues its MLflow run (the id is kept in `output_dir/mlflow-run-id`), each step logged once.
    When the tracking server fails, one warning is printed and training goes on without MLflow
    (MLflow retries a request first: MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT)."""

    tracking_uri: str | None = None
    """Where the run is recorded: a tracking server (`http://host:5000`), a database
    (`sqlite:///mlflow.db`, relative to the working directory; `sqlite:////abs/path.db`) or
    `databricks`; null: MLFLOW_TRACKING_URI, else MLflow's default (`sqlite:///mlflow.db` in the
    working directory, artifacts under `./mlruns`), as the `mlflow` command line and UI expect.
    No credentials in it (`user:password@` is refused)."""
    experiment: str | None = None
    """Experiment name, created when missing; null: MLFLOW_EXPERIMENT_NAME, else
    MLFLOW_EXPERIMENT_ID, else MLflow's `Default` experiment."""
    run_name: str | None = None
    """Run name (default: one MLflow generates)."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags on the run, name -> value."""

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v is not None and re.match(r"^[a-z][a-z0-9+.-]*://[^/@]*:[^/@]*@", v, re.IGNORECASE):
            raise ValueError(
                "holds a password (user:password@): config.yaml would keep it; set MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment instead"
            )
        return v


class LoggingConfig(StrictModel):
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = True
    """TensorBoard event files under `output_dir/tensorboard`."""
    wandb: WandbConfig | None = None
    """Weights & Biases run; null: none."""
    mlflow: MlflowConfig | None = None
    """MLflow run; null: none."""


class Config(StrictModel):
    """A run: model, data, training, distribution, curriculum stages and logging."""

    output_dir: str = "runs/default"
    """The run directory: config.yaml, metrics.jsonl, checkpoints/, final/, loss.png."""
    seed: int = 42
    """Seeds Python, NumPy and torch on every rank (identical initial weights and data order)."""
    overwrite: bool = False
    """Replace a finished or started run in `output_dir` (its outputs are deleted when the new run starts)."""
    model: ModelConfig
    """The model."""
    data: DataConfig
    """The data."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """The optimisation."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Processes, devices and the parallel strategy."""
    stages: list[StageConfig] = Field(default_factory=list)
    """Curriculum stages run in order in one run; empty: one stage named `main`."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metric sinks."""

"""Throughput of scaletune against TRL's SFTTrainer, a plain Hugging Face Trainer script and a bare
PyTorch loop.

One command trains the same model, data, batch, sequence length and precision each way, each in
its own process (so each one's peak memory is its own), and prints non-padding tokens per second,
the ratio to each peer, peak memory, MFU (against a matmul timed on the same machine and, on a GPU
the table knows, against NVIDIA's datasheet peak) and HFU, the utilisation of the FLOPs each trainer
really executes, its attention counted over the rows its kernel really covers:

    python benchmarks/bench.py --preset cpu --model DIR   # a real model folder, fp32 (docs/benchmarks.md)
    python benchmarks/bench.py --preset cpu               # tiny OLMo-2 with random weights
    python benchmarks/bench.py --preset gpu-1b            # Llama-3.2-1B shapes, bf16, seq 2048 (GPU)
    python benchmarks/bench.py --preset smoke             # seconds; what CI runs

The trainers, all on the token sequences scaletune builds (prompt masked with -100), so only the
trainer differs, not the tokenisation:

- ``trl``: TRL's ``SFTTrainer`` with its best options: packing with best-fit decreasing into rows of
  the sequence length, padding-free batches (position ids restart per example), completion-only
  loss, TRL's fused LM head, and Liger's kernels on a GPU (``use_liger_kernel``). Given the
  examples pre-tokenised (``input_ids`` + ``completion_mask``).
- ``hf``: what most people would write: ``AutoModelForCausalLM`` + ``Trainer``, AdamW, the same
  schedule and clipping; with packing (the default) on scaletune's own packed rows (same packing,
  same attention separation by position ids), with ``--no-packing`` padded per batch.
- ``bare``: the floor for framework overhead: scaletune's model + loss module
  (``scaletune.models.loss.CausalLMLoss``) on scaletune's batches (same sampler, same order) in a plain
  ``forward / backward / clip / AdamW.step`` loop, no strategy, scheduler, logging or checkpoint
  code. ``--bare-loss full`` runs the model's own loss (full ``[tokens, vocab]`` logits) instead:
  the before/after of the chunked loss.
- ``scaletune``: ``scaletune train`` on the equivalent YAML, in-process, through the real entry
  point; steps are timed from ``metrics.jsonl``'s ``elapsed_s``.

Timing skips ``--warmup`` steps and measures the next ``--steps``; tokens are non-padding input
tokens of exactly those steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
BUNDLED_ALPACA = REPO / "examples" / "data" / "alpaca_400.json"

TRAINERS = ("trl", "hf", "bare", "scaletune")


@dataclass
class Spec:
    """Everything the three trainers share. Serialised to JSON for the worker processes."""

    preset: str
    model_preset: str  # scaletune.models preset the random-weight model is built from ("" with --model)
    model_dir: str = ""  # the model folder every trainer loads (--model, or the preset built once)
    data: str = str(BUNDLED_ALPACA)
    dtype: str = "float32"  # float32 | bfloat16
    max_seq_length: int = 256
    micro_batch_size: int = 8
    packing: bool = True
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    warmup: int = 3
    steps: int = 20
    learning_rate: float = 2.0e-4
    seed: int = 1234
    bare_loss: str = "chunked"  # chunked | full
    scaletune_set: list[str] = field(default_factory=list)  # extra `key=value` overrides (ablations)
    work_dir: str = ""

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


PRESETS: dict[str, dict[str, Any]] = {
    # The issue's CPU target: tiny OLMo-2 architecture (vocab 100k), micro 8, seq 256, fp32, full FT.
    "cpu": dict(model_preset="olmo2-tiny", dtype="float32", max_seq_length=256, micro_batch_size=8, warmup=3, steps=20),
    # GPU target: Llama-3.2-1B shapes with random weights, bf16, seq 2048, packing.
    "gpu-1b": dict(
        model_preset="llama-3.2-1b",
        dtype="bfloat16",
        max_seq_length=2048,
        micro_batch_size=4,
        warmup=5,
        steps=20,
        gradient_checkpointing=False,
    ),
    # CI: every code path of the harness in seconds; not a timing claim.
    "smoke": dict(model_preset="olmo2-tiny", dtype="float32", max_seq_length=64, micro_batch_size=2, warmup=1, steps=3),
}


# ---------------------------------------------------------------------------------------------
# FLOPs and the device's measured peak


def model_flops_per_token(config: Any, trainable: int, total: int, mean_context: float) -> float:
    """Training FLOPs per token: 6·N + 12·L·d·s (full fine-tuning) or 4·N + 2·N_trainable (LoRA).

    6·N is the forward (2·N) plus the backward (4·N: gradients of activations and of weights)
    of a dense transformer with N parameters, Kaplan et al. 2020 (arXiv:2001.08361, sec. 2.1); the
    attention term 12·L·d·s (L layers, width d, context s) is the PaLM paper's MFU formula
    (Chowdhery et al. 2022, arXiv:2204.02311, appendix B). With frozen weights (LoRA) the backward
    still computes activation gradients (2·N) but no weight gradients: 4·N, plus 2·N_trainable for
    the adapters' own weight gradients.

    N counts every matmul weight: the input embedding table is a lookup, not a matmul, and is left
    out; the output head is a matmul at every token and is counted, also when it shares its weight
    with the embeddings (tied, as Llama-3.2-1B and SmolLM2: `total` counts that tensor once, so it is
    not subtracted then). Leaving a tied head out made Llama-3.2-1B's N 0.97B instead of 1.24B: MFU
    understated by 27%.

    Args:
        config: the model's transformers config (num_hidden_layers, hidden_size, vocab_size,
            tie_word_embeddings).
        trainable: trainable parameters; total: all parameters (each tensor once).
        mean_context: mean attention span per token, sum(t_i^2) / sum(t_i) over the examples.
    """
    embed = config.vocab_size * config.hidden_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    n = total if tied else total - embed  # a tied table is both the lookup and the head: keep it once
    attention = 12 * config.num_hidden_layers * config.hidden_size * mean_context
    if trainable >= total - 1:  # full fine-tuning
        return 6 * n + attention
    return 4 * n + 2 * trainable + attention


def executed_flops_per_token(config: Any, model_flops: float, target_fraction: float) -> float:
    """The FLOPs a trainer executes per token when its head and loss run only at target positions
    (scaletune and the bare loop): the model FLOPs less the head's 6·V·d at the tokens without a
    target. Trainers that run the head at every token execute the model FLOPs."""
    return model_flops - 6 * config.vocab_size * config.hidden_size * (1 - target_fraction)


# Dense peaks (no structured sparsity) in FLOP/s, from NVIDIA's datasheets: "NVIDIA H100 Tensor Core
# GPU" (SXM5 and PCIe columns), "NVIDIA H200 Tensor Core GPU" (SXM column), "NVIDIA A100 Tensor Core
# GPU". The H100/H200 sheets print bf16 with sparsity (1,979 and 1,513 TFLOP/s): dense is half.
# float32 is the non-tensor-core FP32 peak: the measured peak's fp32 matmul does not use TF32.
# Each entry: (words the device name has, words it must not have, {dtype: FLOP/s}). Names are matched
# word by word (torch.cuda.get_device_name(): "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
# "NVIDIA A100-SXM4-80GB"), so a GH200 or an NVL part (other clocks, other peaks) is not taken
# for an H200 or an H100: a device the table lacks has no datasheet MFU rather than a guessed one.
DATASHEET_PEAKS: tuple[tuple[frozenset[str], frozenset[str], dict[str, float]], ...] = (
    (frozenset({"H100", "PCIE"}), frozenset(), {"bfloat16": 756e12, "float32": 51e12}),
    (frozenset({"H100"}), frozenset({"PCIE", "NVL"}), {"bfloat16": 989.4e12, "float32": 67e12}),
    (frozenset({"H200"}), frozenset({"NVL"}), {"bfloat16": 989.4e12, "float32": 67e12}),
    (frozenset({"A100"}), frozenset(), {"bfloat16": 312e12, "float32": 19.5e12}),
)


def datasheet_peak_flops(device_name: str, dtype: str) -> float | None:
    """NVIDIA's dense datasheet peak (FLOP/s) for `device_name` in `dtype`, or None when the table
    has no entry for it (the CPU, any GPU not in :data:`DATASHEET_PEAKS`): unknown, never guessed."""
    import re

    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for has, lacks, peaks in DATASHEET_PEAKS:
        if has <= words and not lacks & words:
            return peaks.get(dtype)
    return None


def measured_peak_flops(device: str, dtype: str, seconds: float = 3.0) -> dict:
    """FLOP/s of the best of repeated square matmuls on `device` in `dtype`: the roofline MFU is
    measured against (not the datasheet number). Size 2048 on CPU, 8192 on CUDA."""
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    n = 8192 if device == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best, deadline = math.inf, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return {"flops_per_s": 2 * n**3 / best, "matmul_size": n, "dtype": dtype, "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# The attention each trainer executes

ATTENTION_BLOCK = 128  # flex_attention's BlockMask block (torch's default; scaletune's packed_mask)


def attention_kernel(attn_implementation: str, device: str) -> str:
    """How the kernel behind `attn_implementation` covers a masked row on `device`.

    ``"block"``: flex_attention with a BlockMask on CUDA (scaletune's default for packed rows
    there, models/attention.py), which skips the 128 x 128 blocks the mask leaves empty.
    ``"varlen"``: flash_attention_*, which transformers runs per example (cu_seqlens from
    position_ids or the padding mask). ``"dense"``: SDPA and eager, which given a mask compute the
    whole row x row score matrix, masked entries included (TRL's padding-free row under SDPA is
    one row of every example of the batch).
    """
    if attn_implementation == "flex_attention" and device == "cuda":
        return "block"
    if attn_implementation.startswith("flash_attention"):
        return "varlen"
    return "dense"


def attention_work(batch: Any, kernel: str, block: int = ATTENTION_BLOCK) -> int:
    """Attention scores one micro-batch computes per head and layer, in PaLM's convention (the full
    square of every span attended over, causal or not; the s of 12·L·d·s, model_flops_per_token).

    ``dense``: row_len² per row, padding included. ``varlen``: example_len² per example (padding
    left out). ``block``: block² for every block pair in which some query and key share an example
    (and the key is not padding): example_len² rounded up to the block, and the blocks where a
    block boundary falls inside an example. Examples are split where position_ids do not step by 1
    (transformers' rule, scaletune.models.attention.sequence_ids); without position_ids a row is
    one example.

    Args:
        batch: a collated micro-batch: ``input_ids`` ``[B, T]``, optional ``position_ids`` and
            ``attention_mask`` (1 real, 0 padding).
        kernel: :func:`attention_kernel`'s answer for the run.
        block: the block mask's block size (``block`` kernel only).
    """
    import torch

    from scaletune.models.attention import sequence_ids

    rows, length = batch["input_ids"].shape
    if kernel == "dense":
        return rows * length * length
    pos = batch.get("position_ids")
    seq = sequence_ids(pos.cpu()) if pos is not None else torch.zeros(rows, length, dtype=torch.long)
    mask = batch.get("attention_mask")
    valid = mask.cpu().bool() if mask is not None else torch.ones(rows, length, dtype=torch.bool)
    blocks = torch.arange(length) // block
    total = 0
    for s, v in zip(seq, valid):
        if kernel == "varlen":
            total += int((torch.bincount(s[v]) ** 2).sum())
            continue
        # Which examples each block holds as queries and as (non-padding) keys; a block pair is
        # computed when the two share one.
        queries = torch.zeros(int(blocks[-1]) + 1, int(s.max()) + 1)
        keys = torch.zeros_like(queries)
        queries[blocks, s] = 1
        keys[blocks[v], s[v]] = 1
        total += int(((queries @ keys.T) > 0).sum()) * block * block
    return total


def _attention_kernel_of(model: Any) -> str:
    return attention_kernel(model.config._attn_implementation, device_type())


def _shape_of(batch: Any) -> dict:
    """What attention_work reads of a collated batch (host tensors, kept until the run ends)."""
    return {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}


# ---------------------------------------------------------------------------------------------
# Shared set-up: the model and the tokenised examples


def _scaletune_dict(spec: Spec, out: Path) -> dict:
    """The YAML scaletune trains (and the data every trainer uses)."""
    return {
        "output_dir": str(out),
        "seed": spec.seed,
        "model": {
            "name_or_path": spec.model_dir,
            "dtype": spec.dtype,
            "attn_implementation": spec.attn_implementation,
            "gradient_checkpointing": spec.gradient_checkpointing,
        },
        "data": {
            "train": {"path": spec.data, "format": "alpaca"},
            "max_seq_length": spec.max_seq_length,
            "packing": spec.packing,
        },
        "training": {
            "global_batch_size": spec.micro_batch_size,
            "micro_batch_size": spec.micro_batch_size,
            "max_steps": spec.total_steps,
            "learning_rate": spec.learning_rate,
            "lr_scheduler": "cosine",
            "warmup_steps": 2,
            "max_grad_norm": 1.0,
            "eval_every": 0,
            "save_every": 0,
            "log_every": 1,
        },
        "distributed": {"strategy": "single", "num_processes": 1},
        "logging": {"tensorboard": False},
    }


def _config(spec: Spec, out: Path, *, packing: bool | None = None):
    from scaletune.config import load_config

    data = _scaletune_dict(spec, out)
    if packing is not None:
        data["data"]["packing"] = packing
    return load_config(None, list(spec.scaletune_set), data=data)


def _examples(spec: Spec, *, packing: bool):
    """(tokenizer, train dataset) exactly as scaletune builds them for this spec."""
    from scaletune.data import build_datasets
    from scaletune.models import load_tokenizer

    cfg = _config(spec, Path(spec.work_dir) / "unused", packing=packing)
    tokenizer = load_tokenizer(cfg.model)
    bundle = build_datasets(cfg.data, tokenizer, seed=cfg.seed)
    return tokenizer, bundle.train


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory() -> dict:
    """Peak CUDA memory allocated by this process, else its peak resident set size (bytes)."""
    import torch

    if torch.cuda.is_available():
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()), "peak_memory_kind": "cuda allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak_memory_bytes": int(rss), "peak_memory_kind": "process RSS"}


def _seed(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def _load_model(spec: Spec):
    import torch
    from transformers import AutoModelForCausalLM

    # fp32 weights in every case: bf16 runs autocast (fp32 master weights), as scaletune does for
    # full fine-tuning and HF Trainer does with `bf16=True`.
    model = AutoModelForCausalLM.from_pretrained(
        spec.model_dir, dtype=torch.float32, attn_implementation=spec.attn_implementation
    )
    model.config.use_cache = False
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device_type())


# ---------------------------------------------------------------------------------------------
# The three trainers (each runs in its own process)


class StepClock:
    """Per-step end times and logged losses for Trainer-based peers (a `TrainerCallback`)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self
        self.ends: list[float] = []
        self.losses: list[float] = []

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                _sync()
                clock.ends.append(time.perf_counter())

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    clock.losses.append(float(logs["loss"]))

        self.callback = Callback()

    def result(self, spec: Spec, tokens: list[int], shapes: list[dict], kernel: str) -> dict:
        """`tokens` and `shapes` (_shape_of) of every collated micro-batch, in step order; their
        attention is counted here, after training, so the count is not in the timed steps."""
        ends, w, n = self.ends, spec.warmup, spec.total_steps
        return {
            "tokens": sum(tokens[w:n]),
            "attention_work": sum(attention_work(b, kernel) for b in shapes[w:n]),
            "attention_kernel": kernel,
            "seconds": ends[n - 1] - ends[w - 1],
            "step_seconds": [b - a for a, b in zip(ends[w - 1 : n - 1], ends[w:n])],
            "first_loss": self.losses[0] if self.losses else None,
        }


def _training_arguments(spec: Spec, cls: Any, name: str, **extra: Any) -> Any:
    """The same optimisation for every Trainer-based peer (HF's default fused AdamW)."""
    return cls(
        output_dir=str(Path(spec.work_dir) / name),
        per_device_train_batch_size=spec.micro_batch_size,
        gradient_accumulation_steps=1,
        max_steps=spec.total_steps,
        learning_rate=spec.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,
        bf16=spec.dtype == "bfloat16",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec.seed,
        dataloader_num_workers=0,
        use_cpu=device_type() == "cpu",
        disable_tqdm=True,
        **extra,
    )


def run_hf(spec: Spec) -> dict:
    """A plain HF Trainer script: on scaletune's packed rows (the same packing) or, with
    `--no-packing`, on the unpacked examples padded per batch."""
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from scaletune.data import Collator, count_input_tokens

    tokenizer, train = _examples(spec, packing=spec.packing)
    if spec.packing:
        # Packed rows carry position_ids restarting per example and no attention mask: transformers
        # masks attention block-diagonally, as for scaletune (data/batching.py).
        train = train.select_columns(["input_ids", "labels", "position_ids"])
        pad = Collator(tokenizer.pad_token_id)
    else:
        train = train.select_columns(["input_ids", "labels"])
        pad = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
    model = _load_model(spec)
    kernel = _attention_kernel_of(model)
    tokens: list[int] = []
    shapes: list[dict] = []

    def collate(rows):
        batch = pad(rows)
        tokens.append(count_input_tokens(batch) if spec.packing else int(batch["attention_mask"].sum()))
        shapes.append(_shape_of(batch))
        return batch

    clock = StepClock()
    args = _training_arguments(spec, TrainingArguments, "hf", remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=[clock.callback])
    trainer.train()
    return clock.result(spec, tokens, shapes, kernel)


def run_trl(spec: Spec) -> dict:
    """TRL's SFTTrainer with its best options (see the module docstring) on the same examples."""
    from trl import SFTConfig, SFTTrainer

    tokenizer, train = _examples(spec, packing=False)
    train = train.map(
        lambda r: {"completion_mask": [int(x != -100) for x in r["labels"]]}, remove_columns=None
    ).select_columns(["input_ids", "completion_mask"])
    model = _load_model(spec)
    cuda = device_type() == "cuda"
    args = _training_arguments(
        spec,
        SFTConfig,
        "trl",
        max_length=spec.max_seq_length,
        packing=spec.packing,
        packing_strategy="bfd",
        padding_free=spec.packing,
        completion_only_loss=True,
        use_liger_kernel=cuda and importlib.util.find_spec("liger_kernel") is not None,
        gradient_checkpointing=spec.gradient_checkpointing,
    )
    clock = StepClock()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=train, processing_class=tokenizer, callbacks=[clock.callback]
    )
    tokens: list[int] = []
    shapes: list[dict] = []
    collate = trainer.data_collator
    kernel = _attention_kernel_of(model)

    def counting(rows):
        batch = collate(rows)
        # Padding-free batches are one row of real tokens; padded ones carry an attention mask.
        mask = batch.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        # Under SDPA the padding-free row is one dense row of the whole batch: its square, not
        # the examples' squares, is what runs (attention_work, counted after the run).
        shapes.append(_shape_of(batch))
        return batch

    trainer.data_collator = counting
    trainer.train()
    return clock.result(spec, tokens, shapes, kernel)


def full_logits_loss(model, mb: dict, device) -> torch.Tensor:
    """Summed next-token loss from the model's full `[tokens, vocab]` logits, upcast to fp32: what
    `model(..., labels=...)` computes, and what the chunked loss avoids."""
    import torch.nn.functional as F

    ids = mb["input_ids"].to(device, non_blocking=True)
    labels = mb["labels"].to(device, non_blocking=True)
    extra = {k: mb[k].to(device, non_blocking=True) for k in ("attention_mask", "position_ids") if k in mb}
    logits = model(input_ids=ids, use_cache=False, **extra).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), reduction="sum")


def _scaletune_batches(spec: Spec, cfg: Any, tokenizer: Any, train: Any):
    """scaletune's micro-batch lists, one per step, in its order (same sampler, seed and collator
    as `scaletune train` at world size 1)."""
    from scaletune.data import Collator, global_batches, make_loader
    from scaletune.env import DistributedEnv
    from scaletune.resolve import batch_arithmetic

    batch = batch_arithmetic(cfg.training, 1, spec.max_seq_length)
    env = DistributedEnv.from_environ()
    loader, sampler = make_loader(train, Collator(tokenizer.pad_token_id), batch, env, cfg.seed, 0)
    steps_per_epoch = len(train) // batch.global_batch_size
    return (micro for _, _, micro in global_batches(loader, sampler, batch, steps_per_epoch))


def run_bare(spec: Spec) -> dict:
    """Plain loop over scaletune's batches: forward, backward, clip, AdamW; nothing else."""
    import contextlib

    import torch

    from scaletune.data import count_input_tokens, count_target_tokens
    from scaletune.env import tune_host_allocator
    from scaletune.models.loss import CausalLMLoss
    from scaletune.strategies.optim import param_groups
    from scaletune.trainer import model_inputs, seed_everything

    if device_type() == "cpu":
        tune_host_allocator()  # the allocator settings scaletune uses: the overhead compares like with like
    tokenizer, train = _examples(spec, packing=spec.packing)
    cfg = _config(spec, Path(spec.work_dir) / "bare")
    seed_everything(cfg.seed)  # scaletune seeds before loading: same LoRA/none init, same order
    model = _load_model(spec)
    module = CausalLMLoss(model).train()
    device = torch.device(device_type())
    opt = torch.optim.AdamW(param_groups(module, 0.0), lr=spec.learning_rate, fused=True)  # as scaletune and HF Trainer
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if spec.dtype == "bfloat16"
        else contextlib.nullcontext
    )
    tokens, first_loss, t0, last, step_seconds, data_seconds = 0, None, 0.0, 0.0, [], 0.0
    timed: list[list[dict]] = []  # the timed steps' micro-batches, their attention counted after the clock
    batches = _scaletune_batches(spec, cfg, tokenizer, train)
    for step in range(1, spec.total_steps + 1):
        fetch = time.perf_counter()
        micro = next(batches)
        if step > spec.warmup:
            data_seconds += time.perf_counter() - fetch  # the loop waiting for its batch
        targets = sum(count_target_tokens(mb["labels"]) for mb in micro)
        step_loss = 0.0
        for mb in micro:
            with autocast():
                if spec.bare_loss == "full":
                    loss = full_logits_loss(model, mb, device) / targets
                else:
                    inputs = {k: v.to(device, non_blocking=True) for k, v in model_inputs(mb).items()}
                    loss = module(**inputs) / targets
            loss.backward()
            if first_loss is None:
                step_loss += float(loss)  # step 1 only: a host sync
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first_loss is None:
            first_loss = step_loss
        if step >= spec.warmup:
            _sync()
            now = time.perf_counter()
            if step == spec.warmup:
                t0 = now
            else:
                tokens += sum(count_input_tokens(mb) for mb in micro)
                timed.append(micro)
                step_seconds.append(now - last)
            last = now
    kernel = _attention_kernel_of(model)  # CausalLMLoss builds the mask this kernel takes (packed_mask)
    return {
        "tokens": tokens,
        "attention_work": sum(attention_work(mb, kernel) for micro in timed for mb in micro),
        "attention_kernel": kernel,
        "seconds": last - t0,
        "step_seconds": step_seconds,
        "data_seconds": data_seconds,
        "first_loss": first_loss,
    }


def run_scaletune(spec: Spec) -> dict:
    """`scaletune train` through its real entry point; times come from metrics.jsonl."""
    import yaml

    from scaletune.run import run_from_cli

    out = Path(spec.work_dir) / "scaletune"
    path = Path(spec.work_dir) / "scaletune.yaml"
    path.write_text(yaml.safe_dump({**_scaletune_dict(spec, out), "overwrite": True}))
    run_dir = run_from_cli(path, list(spec.scaletune_set))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    by_step = {r["step"]: r for r in rows}
    seconds = by_step[spec.total_steps]["elapsed_s"] - by_step[spec.warmup]["elapsed_s"]
    timed = range(spec.warmup + 1, spec.total_steps + 1)
    tokens = sum(by_step[s]["tokens"] for s in timed)
    step_seconds = [by_step[s]["elapsed_s"] - by_step[s - 1]["elapsed_s"] for s in timed]
    work, kernel = _scaletune_attention(spec, out, tokens)
    return {
        "tokens": tokens,
        "attention_work": work,
        "attention_kernel": kernel,
        "seconds": seconds,
        "step_seconds": step_seconds,
        "first_loss": rows[0]["loss"],
    }


def _scaletune_attention(spec: Spec, out: Path, tokens: int) -> tuple[int, str]:
    """(attention_work over the timed steps, kernel) of the `scaletune train` run just made.

    The kernel is the one scaletune chose (models.attention.packed_attention, as model_source
    calls it); the rows are its batches built again, checked against the tokens metrics.jsonl
    logged for those steps, so a count over other rows than the run's is an error, not a number.
    """
    from scaletune.data import count_input_tokens
    from scaletune.models import load_config
    from scaletune.models.attention import packed_attention

    cfg = _config(spec, out)
    packing = cfg.data.packing
    attn = packed_attention(
        cfg.model, load_config(cfg.model) if packing else None, packing=packing, device=device_type()
    )
    kernel = attention_kernel(attn, device_type())
    tokenizer, train = _examples(spec, packing=spec.packing)
    batches = _scaletune_batches(spec, cfg, tokenizer, train)
    replayed, work = 0, 0
    for step in range(1, spec.total_steps + 1):
        micro = next(batches)
        if step > spec.warmup:
            replayed += sum(count_input_tokens(mb) for mb in micro)
            work += sum(attention_work(mb, kernel) for mb in micro)
    if replayed != tokens:
        raise RuntimeError(
            f"scaletune's batches built again hold {replayed} tokens in the timed steps, its "
            f"metrics.jsonl {tokens}: the attention count would be over other rows than it trained"
        )
    return work, kernel


RUNNERS = {"trl": run_trl, "hf": run_hf, "bare": run_bare, "scaletune": run_scaletune}


def worker(name: str, spec_path: Path, result_path: Path) -> None:
    spec = Spec(**json.loads(spec_path.read_text()))
    _seed(spec.seed)
    result = RUNNERS[name](spec)
    result.update(_peak_memory())
    ru = resource.getrusage(resource.RUSAGE_SELF)  # whole process: set-up included
    result["process"] = {"user_s": ru.ru_utime, "system_s": ru.ru_stime, "minor_faults": ru.ru_minflt}
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    result_path.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The parent: build the model, time the matmul, run each trainer, report


def prepare_model(spec: Spec, cache: Path) -> Path:
    """A random-weight model of the preset's shape, saved once and loaded with from_pretrained."""
    from scaletune.models import get_preset, init_model, preset_config

    out = cache / spec.model_preset
    if get_preset(spec.model_preset).tiny:
        return init_model(spec.model_preset, out, seed=0)
    if not (out / "config.json").is_file():  # a large shape: build it here, bf16 to halve the file
        import torch
        from transformers import AutoModelForCausalLM

        from scaletune.models import tokenizer_from_file

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(preset_config(spec.model_preset), dtype=torch.bfloat16)
        model.save_pretrained(out)
        tok_file = REPO / "src" / "scaletune" / "assets" / "olmo2-dolma2.json"
        tokenizer_from_file(tok_file, model_max_length=spec.max_seq_length).save_pretrained(out)
    return out


def data_stats(spec: Spec) -> tuple[float, float]:
    """Over the tokenised examples (unpacked): the mean attention span of a token, sum(t^2) / sum(t),
    and the fraction of tokens whose next token is a target (where scaletune runs the head)."""
    _, train = _examples(spec, packing=False)
    lengths = [len(x) for x in train["input_ids"]]
    targets = sum(sum(1 for y in labels[1:] if y != -100) for labels in train["labels"])
    tokens = max(sum(lengths), 1)
    return sum(t * t for t in lengths) / tokens, targets / tokens


def config_and_size(model_dir: str) -> tuple[Any, int]:
    """The model's config and its total parameter count, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletune.models import parameter_counts

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, parameter_counts(model)[1]


def _run_worker(name: str, spec: Spec, spec_path: Path) -> dict:
    result_path = Path(spec.work_dir) / f"result-{name}.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name, "--spec", str(spec_path), "--result", str(result_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"the {name} trainer failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(result_path.read_text())


def run_all(spec: Spec, trainers: list[str], repeat: int = 1) -> dict:
    """Run each trainer `repeat` times (interleaved) and keep each one's median run."""
    import torch
    import transformers

    import scaletune

    results: dict[str, Any] = {"spec": asdict(spec), "trainers": {}}
    device = device_type()
    results["device"] = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores"
    results["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "scaletune": scaletune.__version__,
        "python": sys.version.split()[0],
    }
    results["peak"] = measured_peak_flops(device, spec.dtype)
    # None on the CPU and on a GPU the table lacks: MFU against it is then unknown, not guessed.
    results["datasheet_peak_flops"] = datasheet_peak_flops(results["device"], spec.dtype) if device == "cuda" else None
    config, total = config_and_size(spec.model_dir)
    ctx, target_fraction = data_stats(spec)
    results["flops_per_token"] = model_flops_per_token(config, total, total, ctx)
    results["executed_flops_per_token"] = executed_flops_per_token(config, results["flops_per_token"], target_fraction)
    results["mean_context"] = ctx
    results["target_fraction"] = target_fraction
    results["parameters"] = total
    results["tied_head"] = bool(getattr(config, "tie_word_embeddings", False))
    spec_path = Path(spec.work_dir) / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    runs: dict[str, list[dict]] = {name: [] for name in trainers}
    for _ in range(repeat):  # interleaved, so a slow spell of the machine hits every trainer alike
        for name in trainers:
            runs[name].append(_run_worker(name, spec, spec_path))
    sheet = results["datasheet_peak_flops"]
    for name, rs in runs.items():
        r = sorted(rs, key=lambda x: x["tokens_per_s"])[len(rs) // 2]  # the median run
        r["mfu"] = r["tokens_per_s"] * results["flops_per_token"] / results["peak"]["flops_per_s"]
        r["mfu_datasheet"] = r["tokens_per_s"] * results["flops_per_token"] / sheet if sheet else None
        # Utilisation on the FLOPs this trainer executes: the attention over the rows its kernel
        # really covered (attention_work: a dense row is its square, padding and other examples
        # included), and the head only at target positions in scaletune and the bare loop, at every
        # token in the peers (and the bare loop's full-logits variant).
        r["attention_span"] = r["attention_work"] / r["tokens"]
        flops = model_flops_per_token(config, total, total, r["attention_span"])
        targets_only = name in ("scaletune", "bare") and not (name == "bare" and spec.bare_loss == "full")
        if targets_only:
            flops = executed_flops_per_token(config, flops, target_fraction)
        r["executed_flops_per_token"] = flops
        r["hfu"] = r["tokens_per_s"] * flops / results["peak"]["flops_per_s"]
        r["runs_tokens_per_s"] = [x["tokens_per_s"] for x in rs]
        results["trainers"][name] = r
    t = results["trainers"]
    if "hf" in t and "scaletune" in t:
        results["speedup_vs_hf"] = t["scaletune"]["tokens_per_s"] / t["hf"]["tokens_per_s"]
    if "trl" in t and "scaletune" in t:
        results["speedup_vs_trl"] = t["scaletune"]["tokens_per_s"] / t["trl"]["tokens_per_s"]
        # The most any trainer executing scaletune's FLOPs could reach against this TRL run: the
        # measured matmul peak spent on nothing else. A target above it needs fewer FLOPs, not speed.
        ceiling = results["peak"]["flops_per_s"] / t["scaletune"]["executed_flops_per_token"]
        results["speedup_vs_trl_ceiling"] = ceiling / t["trl"]["tokens_per_s"]
    if "bare" in t and "scaletune" in t:
        results["overhead_vs_bare"] = 1 - t["scaletune"]["tokens_per_s"] / t["bare"]["tokens_per_s"]
        # Same batches in the same order, so step k has the same tokens in both: the median step
        # time over every timed step of every repeat is the comparison least moved by a noisy machine.
        med = {n: statistics.median(x for r in runs[n] for x in r["step_seconds"]) for n in ("bare", "scaletune")}
        results["median_step_s"] = med
        results["overhead_vs_bare_median_step"] = med["scaletune"] / med["bare"] - 1
    return results


def report(results: dict) -> str:
    s = results["spec"]
    lines = [
        f"device: {results['device']}; {', '.join(f'{k} {v}' for k, v in results['versions'].items())}",
        f"model: {s['model_preset'] or s['model_dir']} ({results['parameters']:,} parameters"
        f"{', tied head' if results['tied_head'] else ''}), {s['dtype']}, micro batch {s['micro_batch_size']}, "
        f"seq {s['max_seq_length']}, packing {s['packing']}, {s['steps']} steps timed after {s['warmup']}",
        f"measured peak: {results['peak']['flops_per_s'] / 1e9:,.1f} GFLOP/s ({results['peak']['dtype']} matmul "
        f"{results['peak']['matmul_size']}^3); model FLOPs/token {results['flops_per_token'] / 1e6:,.1f} M, "
        f"executed with the head at targets only {results['executed_flops_per_token'] / 1e6:,.1f} M "
        f"({100 * results['target_fraction']:.1f}% of tokens have a target)",
        "datasheet peak: "
        + (
            f"{results['datasheet_peak_flops'] / 1e12:,.1f} TFLOP/s ({results['peak']['dtype']}, dense, NVIDIA)"
            if results["datasheet_peak_flops"]
            else "unknown for this device (MFU against it: n/a)"
        ),
        "",
        f"{'trainer':<10} {'tokens/s':>10} {'vs TRL':>7} {'vs HF':>7} {'step ms':>9} {'peak mem':>10} "
        f"{'MFU':>7} {'MFU-ds':>7} {'HFU':>7} {'attn span':>10}",
    ]
    t = results["trainers"]
    for name, r in t.items():
        ratios = [f"{r['tokens_per_s'] / t[p]['tokens_per_s']:.2f}x" if p in t else "-" for p in ("trl", "hf")]
        lines.append(
            f"{name:<10} {r['tokens_per_s']:>10,.0f} {ratios[0]:>7} {ratios[1]:>7} {1000 * r['seconds'] / s['steps']:>9,.1f} "
            f"{r['peak_memory_bytes'] / 2**20:>8,.0f}Mi {100 * r['mfu']:>6.2f}% {_percent(r['mfu_datasheet']):>7} "
            f"{100 * r['hfu']:>6.2f}% {r['attention_span']:>10,.1f} {r['attention_kernel']}"
            + (
                f"   runs: {', '.join(f'{x:,.0f}' for x in r['runs_tokens_per_s'])}"
                if len(r["runs_tokens_per_s"]) > 1
                else ""
            )
        )
    lines += [
        "MFU: model FLOPs (attention over each example alone) against the measured matmul peak; "
        "MFU-ds: the same against the datasheet peak",
        "HFU: utilisation of the measured matmul peak by the FLOPs each trainer executes",
        f"attn span: keys per token its attention kernel computed (sum of row^2 / tokens; dense: whole "
        f"padded or padding-free rows, block: {ATTENTION_BLOCK}-blocks of each example, varlen: each "
        f"example); the model's own: {results['mean_context']:,.1f}",
    ]
    for key, peer in (("speedup_vs_trl", "TRL SFTTrainer"), ("speedup_vs_hf", "HF Trainer")):
        if key in results:
            lines.append(f"scaletune / {peer}: {results[key]:.2f}x")
    if "speedup_vs_trl_ceiling" in results:
        lines.append(
            f"ceiling of scaletune / TRL SFTTrainer at 100% of the measured peak on scaletune's executed "
            f"FLOPs: {results['speedup_vs_trl_ceiling']:.2f}x"
        )
    if "bare" in t:
        b = t["bare"]
        lines.append(f"bare loop waiting for batches: {100 * b['data_seconds'] / b['seconds']:.2f}% of its step time")
    if "overhead_vs_bare" in results:
        lines.append(
            f"scaletune overhead vs the bare loop: {100 * results['overhead_vs_bare']:+.1f}% (tokens/s), "
            f"{100 * results['overhead_vs_bare_median_step']:+.1f}% (median step time)"
        )
    return "\n".join(lines)


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated subset of {','.join(TRAINERS)}")
    p.add_argument("--model", help="a Hugging Face model folder to train (default: the preset's random-weight model)")
    p.add_argument("--steps", type=int, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, help="untimed steps first")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--max-seq-length", type=int)
    p.add_argument("--repeat", type=int, default=1, help="runs per trainer, interleaved; the median is reported")
    p.add_argument("--no-packing", action="store_true", help="scaletune and the bare loop pad instead of packing")
    p.add_argument("--attn-implementation")
    p.add_argument("--bare-loss", choices=["chunked", "full"], default="chunked")
    p.add_argument("--data", help=f"Alpaca JSON (default {BUNDLED_ALPACA.relative_to(REPO)})")
    p.add_argument(
        "--set",
        dest="scaletune_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scaletune override (ablations)",
    )
    p.add_argument(
        "--cache", default=str(Path(tempfile.gettempdir()) / "scaletune-bench"), help="where models are built"
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, Path(a.spec), Path(a.result))
        return 0
    spec = Spec(preset=a.preset, **PRESETS[a.preset])
    for key in ("steps", "warmup", "micro_batch_size", "max_seq_length", "attn_implementation", "data"):
        if getattr(a, key) is not None:
            setattr(spec, key, getattr(a, key))
    spec.packing = not a.no_packing
    spec.bare_loss = a.bare_loss
    spec.scaletune_set = a.scaletune_set
    trainers = [t for t in a.trainers.split(",") if t]
    unknown = sorted(set(trainers) - set(TRAINERS))
    if unknown:
        p.error(f"unknown trainer(s) {', '.join(unknown)}; choose from {', '.join(TRAINERS)}")
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        spec.work_dir = work
        if a.model:
            spec.model_dir, spec.model_preset = str(Path(a.model).resolve()), ""
        else:
            spec.model_dir = str(prepare_model(spec, cache))
        results = run_all(spec, trainers, a.repeat)
    print(report(results))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

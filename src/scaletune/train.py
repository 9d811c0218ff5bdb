"""The training loop, in small named steps (torchtune's recipes): preflight, set up, stages of
optimizer steps, evaluation, logging, export.

The loop is the same for every strategy: it never branches on the engine (strategies/base.py).
One optimizer step consumes one global batch of `global_batch_size` sequences; its loss is the
mean token loss over every target token of that global batch on all ranks, so a step is the same
computation on 1 or 64 ranks and with any micro-batch split (Hugging Face's `num_items_in_batch`
normalisation, transformers#34191, done across ranks).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DistributedSampler

from scaletune.config import (
    BatchArithmetic,
    Config,
    Stage,
    batch_arithmetic,
    dump_config,
    load_config,
    resolve_stages,
    steps_for,
)
from scaletune.env import DistributedEnv, get_logger, print0, set_rank, tune_host_allocator
from scaletune.errors import UserError
from scaletune.checkpoint import (
    Progress,
    check_shapes,
    latest_checkpoint,
    load_rng,
    read_progress,
    resolve_resume,
    save_checkpoint,
)
from scaletune.loss import CausalLMLoss, target_index
from scaletune.plan import track_gradients


# ---------------------------------------------------------------------------------------------
# Entry points


def run_from_cli(config_path: Path | str, overrides: list[str]) -> Path:
    """`scaletune train CONFIG [overrides]`: re-exec under torchrun if several processes are wanted
    and no launcher started us; otherwise train as this rank."""
    env = DistributedEnv.from_environ()
    set_rank(env.rank)
    cfg = load_config(config_path, overrides)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and cfg.training.resume is None:
        # torchrun restarted the job after a failure: continue from the latest checkpoint.
        cfg.training.resume = "auto"
        print0("[scaletune] restarted by torchrun: resuming from the latest checkpoint")
    nproc = wanted_processes(cfg, env)
    if not env.launched and nproc > 1:
        # Bad input is reported here, once, with exit 2, rather than by every rank under torchrun.
        preflight(cfg, dataclasses.replace(env, world_size=nproc, local_world_size=nproc))
        _reexec_under_torchrun(nproc, config_path, overrides)
    return train(cfg, env)


def wanted_processes(cfg: Config, env: DistributedEnv) -> int:
    """Processes a plain `scaletune train` should start: `num_processes`, or for `auto` one per
    visible GPU (so four visible GPUs never train on one).

    Raises:
        UserError: more processes than visible GPUs on a GPU machine.
    """
    n = cfg.distributed.num_processes
    if n == "auto":
        return max(1, env.cuda_device_count)
    if env.cuda_available and n > env.cuda_device_count:
        raise UserError(
            f"distributed.num_processes is {n} but only {env.cuda_device_count} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); set it to "
            f"{env.cuda_device_count} or auto",
            title="invalid config",
        )
    return n


def _reexec_under_torchrun(nproc: int, config_path: Path | str, overrides: list[str]) -> None:
    from scaletune.launch.commands import single_node_torchrun_argv

    argv = single_node_torchrun_argv(sys.executable, nproc, [str(config_path), *overrides])
    print0(f"[scaletune] starting {nproc} processes: {' '.join(argv)}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


# ---------------------------------------------------------------------------------------------
# Preflight: everything that can fail on bad input fails here, before anything is written.


@dataclass
class Preflight:
    cfg: Config  # with `distributed.strategy: auto` resolved by the planner
    strategy: str
    batch: BatchArithmetic
    stages: list[Stage]
    run_dir: Path
    max_positions: int | None
    resume_from: Path | None = None


def preflight(cfg: Config, env: DistributedEnv) -> Preflight:
    """Validate config, data and run directory together; raise one UserError naming every problem."""
    from scaletune.data import check_packing_support, validate_data
    from scaletune.models import load_config as read_model_config
    from scaletune.models import max_positions
    from scaletune.strategies import choose_strategy

    from scaletune.doctor import preflight as doctor_preflight

    problems: list[str] = []
    try:
        for check in doctor_preflight(cfg, env):
            if check.status == "WARN":
                print0(f"[scaletune] warning: {check.name}: {check.message} (fix: {check.fix})")
    except UserError as exc:
        problems += exc.problems
    if cfg.distributed.strategy == "auto":
        from scaletune.plan import choose_auto_strategy

        try:
            name, overrides = choose_auto_strategy(cfg, env)
            cfg = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"strategy": name, **overrides})})
            print0(f"[scaletune] distributed.strategy auto -> {name} {overrides or ''}".rstrip())
        except UserError as exc:
            problems += exc.problems
    strategy = choose_strategy(cfg, env)
    if cfg.model.liger and strategy == "deepspeed" and cfg.distributed.zero_stage == 3:
        # The YAML check cannot see what `auto` picks: Liger's fused loss needs the whole lm_head weight.
        problems.append("model.liger cannot run with DeepSpeed ZeRO-3 (chosen by distributed.strategy auto): "
                        "the lm_head weight is partitioned outside its forward; set distributed.strategy fsdp or zero_stage 2")
    if strategy == "single" and env.world_size > 1:
        problems.append(
            f"distributed.strategy single cannot run on {env.world_size} ranks; use ddp, fsdp or deepspeed"
        )
    if strategy == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            problems = [p for p in problems if not p.startswith("deepspeed ops:")]  # said better here
            problems.append(
                "distributed.strategy deepspeed needs DeepSpeed: pip install 'scaletune[deepspeed]' "
                "(or choose ddp or fsdp)"
            )
    stages = resolve_stages(cfg)
    batch = None
    for stage in stages:
        try:
            b = batch_arithmetic(stage.training, env.world_size, stage.data.max_seq_length)
            batch = batch or b
        except UserError as exc:
            # The doctor's batch check reports the same arithmetic; keep one line of it.
            problems = [p for p in problems if not p.startswith("batch arithmetic:")] + exc.problems
            break
    positions = None
    try:
        positions = max_positions(read_model_config(cfg.model))
    except UserError as exc:
        problems += exc.problems
    for stage in stages:
        if positions is not None and stage.data.max_seq_length > positions:
            problems.append(
                f"data.max_seq_length ({stage.data.max_seq_length}) is larger than the model's "
                f"{positions} positions (max_position_embeddings); lower it"
            )
        try:
            validate_data(stage.data)
            if stage.data.packing:
                check_packing_support(cfg.model.attn_implementation, stage.training.micro_batch_size)
        except UserError as exc:
            problems += [p for p in exc.problems if p not in problems]
    run_dir = Path(cfg.output_dir)
    if env.is_main:  # rank 0 alone decides: it may already have created the directory
        problems += _run_dir_problems(cfg, run_dir)
    resume_from = None
    try:
        resume_from = resolve_resume(cfg, run_dir)
    except UserError as exc:
        problems += exc.problems
    if problems:
        raise UserError(problems, title="cannot start training")
    assert batch is not None
    return Preflight(cfg, strategy, batch, stages, run_dir, positions, resume_from)


_RUN_MARKERS = ("config.yaml", "metrics.jsonl", "final")


def _run_dir_problems(cfg: Config, run_dir: Path) -> list[str]:
    if not run_dir.exists():
        return []
    if not run_dir.is_dir():
        return [f"output_dir {run_dir} exists and is not a directory"]
    held = [m for m in _RUN_MARKERS if (run_dir / m).exists()]
    if held and not cfg.overwrite and cfg.training.resume is None:
        what = "a finished run (final/ present)" if "final" in held else f"a previous run ({', '.join(held)})"
        return [
            f"output_dir {run_dir} holds {what}; choose another output_dir, set overwrite: true "
            "to replace it, or training.resume: auto to continue it"
        ]
    return []


def prepare_run_dir(cfg: Config, run_dir: Path, env: DistributedEnv, *, resuming: bool = False) -> None:
    """Rank 0 creates the run directory (clearing a previous run only under `overwrite: true`)
    and writes the resolved config. A fresh start under `resume: auto` keeps an earlier run's
    metrics as `metrics.jsonl.prev` rather than mixing the two curves."""
    if env.is_main:
        metrics = run_dir / "metrics.jsonl"
        if not resuming and cfg.training.resume == "auto" and metrics.exists():
            os.replace(metrics, run_dir / "metrics.jsonl.prev")
        if cfg.overwrite and run_dir.exists() and cfg.training.resume is None:
            for m in (*_RUN_MARKERS, "loss.png", "tensorboard", "checkpoints", "plan.json", "memory.json"):
                target = run_dir / m
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))


# ---------------------------------------------------------------------------------------------
# The loss


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors `loss.CausalLMLoss.forward` takes, with the target positions added on the host."""
    out = {k: batch[k] for k in ("input_ids", "labels", "attention_mask", "position_ids") if k in batch}
    out["target_index"] = target_index(batch["labels"])
    return out


# ---------------------------------------------------------------------------------------------
# Seeds, data loading


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights (LoRA init included) everywhere."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` that can skip the samples of this rank already consumed in the epoch
    a run resumes in (the permutation does not depend on world size, so neither does the skip).

    `skip` applies to the next iteration only.
    """

    skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


def make_loader(dataset: Any, collator: Any, batch: BatchArithmetic, env: DistributedEnv, seed: int, num_workers: int):
    """A DataLoader of micro-batches for this rank.

    `DistributedSampler` draws one permutation of all rows (seeded by seed + epoch, the same at
    every world size) and gives rank r rows r, r+W, r+2W, ...; so the first global batch is
    permutation[0:global_batch_size] whatever W is, split across ranks and micro-batches.
    """
    from torch.utils.data import DataLoader

    sampler = ResumableSampler(
        dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=batch.micro_batch_size,
        sampler=sampler,
        collate_fn=collator,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=env.cuda_available,
        persistent_workers=num_workers > 0,
    )
    return loader, sampler


def global_batches(loader: Any, sampler: Any, batch: BatchArithmetic, steps_per_epoch: int, first_epoch: int = 0, first_step: int = 0) -> Iterator[tuple[int, int, list]]:
    """Yield (epoch, step_in_epoch, micro_batches) forever, one global batch per step, starting at
    step `first_step` of epoch `first_epoch` (a resumed run)."""
    gas = batch.gradient_accumulation_steps
    epoch, start = first_epoch, first_step
    while True:
        sampler.set_epoch(epoch)
        sampler.skip = start * gas * batch.micro_batch_size
        it = iter(loader)
        for i in range(start, steps_per_epoch):
            yield epoch, i, [next(it) for _ in range(gas)]
        epoch, start = epoch + 1, 0


def make_scheduler(optimizer: torch.optim.Optimizer, stage: Stage, total_steps: int):
    """Warmup then cosine / linear decay (to `min_lr_ratio` x peak for cosine) or constant,
    from transformers' schedule implementations."""
    from transformers import get_scheduler

    t = stage.training
    for group in optimizer.param_groups:
        # LambdaLR scales `initial_lr`, which the first stage's scheduler fixed: a stage sets its own peak.
        group["lr"] = group["initial_lr"] = t.learning_rate
    warmup = min(t.warmup_steps, total_steps)
    if t.lr_scheduler == "cosine" and t.min_lr_ratio > 0:
        return get_scheduler(
            "cosine_with_min_lr", optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
            scheduler_specific_kwargs={"min_lr_rate": t.min_lr_ratio},
        )
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[t.lr_scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


# ---------------------------------------------------------------------------------------------
# One optimizer step, one evaluation


@dataclass
class StepResult:
    loss: torch.Tensor  # global mean token loss (0-dim, on device)
    grad_norm: torch.Tensor
    tokens: torch.Tensor  # non-padding tokens, global count


def train_step(strategy: Any, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
    """Forward/backward every micro-batch of this rank's share of the global batch, then step.

    The loss of each micro-batch is its summed token loss divided by the target tokens of the
    whole global batch (all-reduced first), so accumulation and world size do not change the step.
    """
    from scaletune.data import count_input_tokens, count_target_tokens

    device = strategy.device
    counts = torch.tensor(
        [sum(count_target_tokens(mb["labels"]) for mb in micro_batches), sum(count_input_tokens(mb) for mb in micro_batches)],
        dtype=torch.float64,
    )
    counts = strategy.all_reduce_sum(counts)
    global_targets = counts[0].clamp(min=1)
    loss_total = torch.zeros((), dtype=torch.float32, device=device)
    denominator = global_targets.to(device, torch.float32)
    n = len(micro_batches)
    for i, mb in enumerate(micro_batches):
        inputs = {k: v.to(device, non_blocking=True) for k, v in model_inputs(mb).items()}
        with strategy.micro_step(is_last=i == n - 1):
            with strategy.forward_context():
                loss = strategy.model(**inputs) / denominator
            strategy.backward(loss)
        loss_total += loss.detach()
    grad_norm = strategy.step()
    loss_global = strategy.all_reduce_sum(loss_total)
    return StepResult(loss_global, grad_norm, counts[1])


@torch.no_grad()
def evaluate(strategy: Any, loader: Any) -> float:
    """Mean token loss over the whole eval set (all ranks)."""
    from scaletune.data import count_target_tokens

    strategy.train_mode(False)
    total = torch.zeros(2, dtype=torch.float64)
    for mb in loader:
        inputs = {k: v.to(strategy.device) for k, v in model_inputs(mb).items()}
        with strategy.forward_context():
            total[0] += float(strategy.model(**inputs))
        total[1] += count_target_tokens(mb["labels"])
    strategy.train_mode(True)
    total = strategy.all_reduce_sum(total).cpu()
    return float(total[0] / max(total[1], 1))


def make_eval_loader(dataset: Any, collator: Any, batch: BatchArithmetic, env: DistributedEnv):
    """Each rank evaluates every W-th row; no row is dropped or repeated (sums are all-reduced)."""
    from torch.utils.data import DataLoader

    indices = list(range(env.rank, len(dataset), env.world_size))
    return DataLoader(
        torch.utils.data.Subset(dataset, indices), batch_size=batch.micro_batch_size, collate_fn=collator
    )


# ---------------------------------------------------------------------------------------------
# Logging


class RunLogger:
    """metrics.jsonl, TensorBoard and the progress bar; a no-op on ranks other than 0."""

    def __init__(self, cfg: Config, run_dir: Path, env: DistributedEnv) -> None:
        self.active = env.is_main
        self._tb = None
        self._file = None
        self._progress = None
        if not self.active:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def start_progress(self, total: int, description: str, completed: int = 0) -> None:
        if not self.active:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=completed, loss="-", tps="-")

    def log(self, record: dict) -> None:
        if not self.active:
            return
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step",):
                    self._tb.add_scalar(f"{'eval' if k.startswith('eval') else 'train'}/{k}", v, record["step"])
        if self._progress is not None and "loss" in record:
            self._progress.update(
                self._task, completed=record["stage_step"], loss=f"{record['loss']:.4f}", tps=f"{record['tokens_per_s']:,.0f}"
            )
        elif "eval_loss" in record:
            print0(f"[scaletune] step {record['step']} eval_loss {record['eval_loss']:.4f}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()


def plot_losses(history: list[dict], path: Path) -> None:
    """loss.png: training loss per step and eval loss where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    ev = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean token loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class RunState:
    step: int = 0  # optimizer steps since the run began
    start_time: float = field(default_factory=time.perf_counter)
    resume: Progress | None = None  # where a resumed run continues
    resume_path: Path | None = None
    resume_scheduler: dict | None = None
    memory_reported: bool = False


def report_memory(cfg: Config, strategy: Any, env: DistributedEnv, run_dir: Path) -> None:
    """After the first optimizer step: every rank measures what it holds; rank 0 writes
    `memory.json` (all ranks) and `plan.json` (the planner's prediction for this strategy) and
    prints them side by side."""
    import torch.distributed as dist

    from scaletune.plan import measure_memory, plan

    mine = measure_memory(strategy)
    ranks = [mine]
    if dist.is_initialized() and env.world_size > 1:
        ranks = [None] * env.world_size
        dist.all_gather_object(ranks, mine)
    if not env.is_main:
        return
    (run_dir / "memory.json").write_text(json.dumps({"ranks": ranks}, indent=2) + "\n")
    try:
        entry = plan(cfg, world_size=env.world_size, gpu_memory_bytes=None, cuda=env.cuda_available).for_strategy(
            strategy.name, cfg.distributed
        )
    except (KeyError, UserError, ValueError) as exc:  # a layout the planner does not model
        print0(f"[scaletune] no memory plan for this run: {exc}")
        return
    predicted = entry.to_json()
    (run_dir / "plan.json").write_text(json.dumps(predicted, indent=2) + "\n")
    per_rank = predicted["per_rank_bytes"]
    lines = [f"[scaletune] memory per rank (MiB), planned ({predicted['name']}) vs measured on rank 0:"]
    for key in ("params", "grads", "optimizer"):
        lines.append(f"[scaletune]   {key:<10} {per_rank[key] / 2**20:>10.1f} {mine[key] / 2**20:>10.1f}")
    peak = "n/a (no allocator on CPU)" if mine["peak_device"] is None else f"{mine['peak_device'] / 2**20:.1f}"
    lines.append(f"[scaletune]   {'total':<10} {per_rank['total'] / 2**20:>10.1f}  peak device: {peak}")
    print0("\n".join(lines))


class DivergenceError(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before any checkpoint of that state."""


def train(cfg: Config, env: DistributedEnv | None = None) -> Path:
    """Train per `cfg` as this rank; returns the run directory.

    Raises:
        UserError: bad config or data (before anything is written), or a checkpoint that cannot resume.
        DivergenceError: the loss or gradient norm became NaN or infinite.
        RuntimeError: a wrong environment (no GPU for quantization, missing launcher variables).
    """
    from scaletune.strategies import make_strategy
    from scaletune.strategies.base import torn_down

    env = env or DistributedEnv.from_environ()
    set_rank(env.rank)
    log = get_logger()
    if env.device.type == "cpu":
        tune_host_allocator()  # before the model and data are allocated
    pre = preflight(cfg, env)
    cfg = pre.cfg
    strategy = make_strategy(pre.strategy, cfg, env, pre.batch)
    with torn_down(strategy):
        print0(f"[scaletune] {env.describe()}")
        print0(f"[scaletune] {strategy.describe()}")
        print0(f"[scaletune] {pre.batch.describe()}")
        seed_everything(cfg.seed)
        tokenizer, model = _load(cfg, strategy, env)
        if pre.resume_from is None and cfg.training.resume == "auto":
            print0(f"[scaletune] training.resume auto: no checkpoint in {pre.run_dir / 'checkpoints'}, starting fresh")
        prepare_run_dir(cfg, pre.run_dir, env, resuming=pre.resume_from is not None)
        strategy.barrier()
        progress = read_progress(pre.resume_from) if pre.resume_from is not None else None
        if progress is not None:
            strategy.prepare_resume(pre.resume_from, progress.world_size)
        strategy.wrap(CausalLMLoss(model, activation_offload=cfg.model.activation_offload, liger=cfg.model.liger))
        track_gradients(strategy)
        state = RunState()
        if progress is not None:
            _resume(strategy, pre.resume_from, progress, state, env)
            if env.is_main:
                _truncate_metrics(pre.run_dir / "metrics.jsonl", state.step)
        plans = plan_stages(cfg, pre.stages, tokenizer, strategy, env, pre.max_positions)
        logger = RunLogger(cfg, pre.run_dir, env)
        try:
            for plan in plans:
                _run_stage(cfg, plan, plans, strategy, tokenizer, pre, state, logger, env)
            final = pre.run_dir / "final"
            strategy.export(final)
            if env.is_main:
                tokenizer.save_pretrained(str(final))
                # From the file, not this process's records: a resumed run plots the whole curve.
                plot_losses(_read_metrics(pre.run_dir / "metrics.jsonl"), pre.run_dir / "loss.png")
                log.info(f"saved {final}")
        finally:
            logger.close()
        strategy.barrier()
    return pre.run_dir


def _resume(strategy: Any, path: Path, progress: Progress, state: RunState, env: DistributedEnv) -> None:
    """Load model and optimizer from `path` (whose `progress` was read); say what was resharded."""
    if progress.checkpoint_format != strategy.checkpoint_format:
        raise UserError(
            f"{path} was written by strategy {progress.strategy} ({progress.checkpoint_format} format) and "
            f"cannot resume under {strategy.name}; export it (scaletune export) and fine-tune from the export",
            title="cannot resume",
        )
    if progress.checkpoint_format == "dcp":
        check_shapes(path, strategy.state_shapes())
    strategy.load_state(path)
    state.step = progress.step
    state.resume, state.resume_path = progress, path
    state.resume_scheduler = json.loads((path / "scheduler.json").read_text())
    if progress.world_size != env.world_size:
        how = "torch.distributed.checkpoint" if progress.checkpoint_format == "dcp" else "DeepSpeed's universal checkpoint"
        print0(
            f"[scaletune] resharded {path.name}: written by {progress.world_size} rank(s) ({progress.strategy}), "
            f"now {env.world_size}; model and optimizer state re-split by {how}, "
            f"data resumes at sample {progress.sample_offset} of epoch {progress.epoch}"
        )
    else:
        print0(f"[scaletune] resumed from {path} at step {progress.step} (stage {progress.stage_name})")


def _read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop lines past the checkpoint's step that a crashed run logged, so the curve continues."""
    keep = [r for r in _read_metrics(path) if r.get("step", 0) <= step]
    if path.is_file():
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def _load(cfg: Config, strategy: Any, env: DistributedEnv):
    from scaletune.models import load_tokenizer, prepare_model, resolve_device_map

    placement = resolve_device_map(cfg.model.device_map, env, engine_places_model=strategy.engine_places_model)
    tokenizer = load_tokenizer(cfg.model)
    storage = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[strategy.precision.storage]
    model = prepare_model(cfg.model.model_copy(update={"dtype": storage}), placement, meta=strategy.load_meta())
    return tokenizer, model


def _build_data(stage: Stage, tokenizer: Any, cfg: Config, strategy: Any, env: DistributedEnv, positions: int | None):
    """Rank 0 tokenizes first (filling the datasets cache); the other ranks then read the cache."""
    from scaletune.data import build_datasets

    bundle = None
    if env.is_main:
        bundle = build_datasets(stage.data, tokenizer, seed=cfg.seed, max_positions=positions)
    strategy.barrier()
    if not env.is_main:
        bundle = build_datasets(stage.data, tokenizer, seed=cfg.seed, max_positions=positions)
    return bundle


@dataclass
class StagePlan:
    """A stage with its data built and its step counts known."""

    stage: Stage
    batch: BatchArithmetic
    bundle: Any
    steps_per_epoch: int
    total: int  # optimizer steps of this stage
    schedule_steps: int  # steps the learning-rate schedule spans (longer when later stages continue it)
    schedule_origin: int  # index of the stage whose schedule this one runs on (itself unless continuing)


def plan_stages(cfg: Config, stages: list[Stage], tokenizer: Any, strategy: Any, env: DistributedEnv, positions: int | None) -> list[StagePlan]:
    """Build every stage's data before the first step (bad data fails early) and count its steps.

    Raises:
        UserError: a stage with fewer sequences than one global batch.
    """
    plans = []
    for stage in stages:
        batch = batch_arithmetic(stage.training, env.world_size, stage.data.max_seq_length)
        bundle = _build_data(stage, tokenizer, cfg, strategy, env, positions)
        steps_per_epoch = len(bundle.train) // batch.global_batch_size
        if steps_per_epoch == 0:
            raise UserError(
                f"stage {stage.name}: {len(bundle.train)} training sequences are fewer than one global batch "
                f"({batch.global_batch_size}); add data or lower training.global_batch_size",
                title="cannot start training",
            )
        total = steps_for(steps_per_epoch, stage.training)
        origin = plans[-1].schedule_origin if (stage.continue_schedule and plans) else stage.index
        plans.append(StagePlan(stage, batch, bundle, steps_per_epoch, total, total, origin))
        print0(
            f"[scaletune] stage {stage.name}: {len(bundle.train)} sequences, {steps_per_epoch} steps per epoch, "
            f"{total} optimizer steps; data {json.dumps(bundle.stats)}"
        )
    # A stage that continues the schedule extends the horizon of the stage that started it.
    for p in plans:
        if p.schedule_origin != p.stage.index:
            plans[p.schedule_origin].schedule_steps += p.total
    for p in plans:
        p.schedule_steps = plans[p.schedule_origin].schedule_steps
    return plans


def _run_stage(cfg: Config, plan: StagePlan, plans: list[StagePlan], strategy: Any, tokenizer: Any, pre: Preflight, state: RunState, logger: RunLogger, env: DistributedEnv) -> None:
    from scaletune.data import Collator

    stage, batch, bundle, steps_per_epoch, total = plan.stage, plan.batch, plan.bundle, plan.steps_per_epoch, plan.total
    start = state.resume
    if start is not None and (start.stage_index > stage.index or (start.stage_index == stage.index and start.stage_complete)):
        return  # finished before the checkpoint
    resuming_here = start is not None and start.stage_index == stage.index
    collator = Collator(tokenizer.pad_token_id)
    loader, sampler = make_loader(bundle.train, collator, batch, env, cfg.seed, stage.data.num_workers)
    eval_loader = make_eval_loader(bundle.eval, collator, batch, env) if bundle.eval is not None else None
    if strategy.scheduler is None or plan.schedule_origin == stage.index:
        # A continuing stage keeps the running schedule; resumed into one, it rebuilds its origin's
        # schedule and the saved scheduler state restores the position.
        strategy.scheduler = make_scheduler(strategy.optimizer, plans[plan.schedule_origin].stage, plan.schedule_steps)
    first_step, first_epoch, done = 0, 0, 0
    if resuming_here:
        assert start is not None and state.resume_scheduler is not None
        strategy.scheduler.load_state_dict(state.resume_scheduler)
        for group, lr in zip(strategy.optimizer.param_groups, strategy.scheduler.get_last_lr()):
            group["lr"] = lr
        first_epoch, first_step, done = start.epoch, start.step_in_epoch, start.stage_step
        load_rng(state.resume_path, env.rank)  # after data building, right before the next step
    state.resume = None
    strategy.train_mode(True)
    logger.start_progress(total, f"{stage.name}", completed=done)
    t = stage.training
    window_start, window_tokens = time.perf_counter(), 0.0
    batches = global_batches(loader, sampler, batch, steps_per_epoch, first_epoch, first_step)
    for stage_step, (epoch, i, micro) in enumerate(batches, done + 1):
        if stage_step > total:
            break
        lr = strategy.lr()
        result = train_step(strategy, micro)
        state.step += 1
        if not state.memory_reported:
            report_memory(cfg, strategy, env, pre.run_dir)
            state.memory_reported = True
        window_tokens += float(result.tokens)
        last = stage_step == total
        will_save = last or bool(t.save_every and state.step % t.save_every == 0)
        if stage_step % t.log_every == 0 or last or will_save:
            loss, grad_norm = float(result.loss), float(result.grad_norm)
            now = time.perf_counter()
            logger.log({
                "step": state.step,
                "stage": stage.name,
                "stage_step": stage_step,
                "epoch": round(epoch + (i + 1) / steps_per_epoch, 4),
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens": int(result.tokens),
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                "elapsed_s": round(now - state.start_time, 3),
            })
            window_start, window_tokens = now, 0.0
            # NaN grad norms are DeepSpeed's "no norm computed"; an infinite or NaN loss is not.
            if not math.isfinite(loss) or math.isinf(grad_norm):
                good = latest_checkpoint(pre.run_dir)
                raise DivergenceError(
                    f"training diverged at step {state.step}: loss {loss}, grad_norm {grad_norm}; "
                    f"no checkpoint was written for it. Last good checkpoint: {good or 'none'} "
                    "(lower training.learning_rate or raise warmup_steps, then resume from it)"
                )
        if eval_loader is not None and ((t.eval_every and stage_step % t.eval_every == 0) or last):
            logger.log({"step": state.step, "stage": stage.name, "eval_loss": evaluate(strategy, eval_loader),
                        "elapsed_s": round(time.perf_counter() - state.start_time, 3)})
        if will_save:
            next_epoch, next_step = (epoch, i + 1) if i + 1 < steps_per_epoch else (epoch + 1, 0)
            progress = Progress(
                step=state.step, stage_index=stage.index, stage_name=stage.name, stage_step=stage_step,
                epoch=next_epoch, step_in_epoch=next_step, sample_offset=next_step * batch.global_batch_size,
                world_size=env.world_size, strategy=strategy.name, checkpoint_format=strategy.checkpoint_format,
                stage_complete=last,
            )
            path = save_checkpoint(strategy, pre.run_dir, progress, cfg, strategy.scheduler.state_dict(), keep_last=t.keep_last)
            print0(f"[scaletune] saved checkpoint {path}")

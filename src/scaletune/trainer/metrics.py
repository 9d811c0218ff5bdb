"""Metrics of a run: `metrics.jsonl`, TensorBoard, Weights & Biases, MLflow (`trainer.tracking`)
and the progress display (rank 0 only; a no-op logger on other ranks), and `loss.png` drawn from the
metrics file."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.config import Config, redacted
from scaletune.env import DistributedEnv, print0
from scaletune.report import reporter

if TYPE_CHECKING:
    import torch

    from scaletune.resolve import RunSpec
    from scaletune.trainer.tracking import MlflowTracker, Outcome

#: The file in `output_dir/wandb/` naming the W&B run, so a resumed run continues it.
WANDB_ID = "scaletune-run-id"


def _sink_key(key: str) -> str:
    """`eval_loss` -> `eval/loss`, `loss` -> `train/loss`: the same names in TensorBoard, W&B and MLflow."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


class ThroughputWindow:
    """Tokens counted since the last logged step, and when that was (metrics.jsonl `tokens_per_s`).

    Args:
        clock: seconds, monotonic (`time.perf_counter`).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.since = clock()
        self.tokens: float | torch.Tensor = 0.0

    def add(self, tokens: float | torch.Tensor) -> None:
        """One step's non-padding tokens, all ranks: a number, or a tensor summed where it lives (a
        GPU's count is not read back to the host each step; :meth:`close` reads the sum once)."""
        self.tokens = self.tokens + tokens

    def close(self, now: float, tokens: float | None = None) -> float:
        """Tokens per second over the window ending at `now`; a new window starts there.

        Args:
            tokens: the window's sum (:attr:`tokens`) where the caller has read it already (the loop
                reads it with the step's loss, `host_values`); else it is read here.
        """
        rate = float(self.tokens if tokens is None else tokens) / max(now - self.since, 1e-9)
        self.since, self.tokens = now, 0.0
        return rate


def host_values(*values: float | torch.Tensor) -> list[float]:
    """`values` as Python floats, the tensors among them (0-dim, any devices) read in one copy.

    A logged step's loss, gradient norm, skip flag and token counts live on the device until the
    step is logged; reading each with `float()` would wait for the device once per value, this
    waits once for all of them. Numbers pass through.
    """
    import torch

    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    device = tensors[0].device
    read = iter(torch.stack([t.detach().to(device, torch.float64).reshape(()) for t in tensors]).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]


#: Per-rank lists in a metrics line up to this many ranks: serve takes lists of up to 256 values.
MAX_RANKS_LISTED = 256


def rank_resources(
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], world_size: int, rank: int, device_peak: int | None
) -> dict:
    """What each rank holds, for a metrics line (the page's memory per rank): `memory_bytes`, one
    number per rank (`device_peak`, the strategy's `memory.peak_device_bytes` over the devices it
    computes on, on CUDA; the process's resident set where that is None, on the CPU; named by
    `memory_of`), and `gpu_util`, percent per rank, where every rank's
    `torch.cuda.utilization()` answers (it needs NVML; left out otherwise). Past MAX_RANKS_LISTED
    ranks, `memory_max_bytes` (the largest rank's) instead of the lists. A collective on the
    training group (one all-reduce of a small tensor), so every rank calls it, on log steps only.
    Raises nothing of its own: a failed collective is the training group's failure.
    """
    import torch

    cuda = device_peak is not None
    if cuda:
        mine = float(device_peak)
        try:
            util = float(torch.cuda.utilization())
        except Exception:  # noqa: BLE001 - no NVML (pynvml) or a device it cannot read: no utilisation
            util = -1.0
    else:
        import psutil

        mine, util = float(psutil.Process().memory_info().rss), -1.0
    # Rank r's pair in slots r and world_size + r; the others' zeros: the sum gathers them.
    slots = torch.zeros(2 * world_size, dtype=torch.float64)
    slots[rank], slots[world_size + rank] = mine, util
    got = all_reduce_sum(slots).cpu().tolist() if world_size > 1 else slots.tolist()
    memory, utils = [int(v) for v in got[:world_size]], [round(u) for u in got[world_size:]]
    out: dict = {"memory_of": "device peak" if cuda else "process rss"}
    if world_size > MAX_RANKS_LISTED:  # a list serve would refuse: the largest rank only
        out["memory_max_bytes"] = max(memory)
        return out
    out["memory_bytes"] = memory
    if cuda and all(u >= 0 for u in utils):
        out["gpu_util"] = utils
    return out


class RunLogger:
    """metrics.jsonl, TensorBoard, W&B, MLflow and the progress display; a no-op on ranks other than 0.

    The progress display is a live bar when stderr is a terminal and one plain line per logged
    step otherwise (CI logs, `nohup`, pipes), so redirected output stays readable.

    Raises:
        RuntimeError: `logging.wandb` or `logging.mlflow` is set and its package is not installed
            (train's preflight says so first).
    """

    def __init__(self, run_dir: Path, env: DistributedEnv, cfg: Config) -> None:
        self.active = env.is_main
        self._tb = None
        self._wandb = None
        self._mlflow: MlflowTracker | None = None
        self._file = None
        self._progress = None
        self._lines: dict | None = None  # line mode: description, total, start time, first step
        self._headline: tuple[str, ...] = ()  # the stage objective's console metrics (`objective`)
        if not self.active:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.logging.wandb is not None:
            self._wandb = _start_wandb(cfg, run_dir)
        if cfg.logging.mlflow is not None:
            from scaletune.trainer.tracking import MlflowTracker

            self._mlflow = MlflowTracker(cfg, run_dir)

    def objective(self, name: str) -> None:
        """The stage's training objective: its headline metrics (`ObjectiveFacts.headline`) join the
        console's step and eval lines from now on."""
        from scaletune.config.preference import OBJECTIVES

        self._headline = OBJECTIVES[name].headline

    def _headline_text(self, record: dict, prefix: str = "") -> str:
        """` perplexity 8.21`, ` eval_reward_accuracy 0.9375 eval_reward_margin 1.2040`: the
        objective's headline metrics of `record` (`prefix` "eval_" on evaluation lines)."""
        parts = []
        for key in self._headline:
            if key == "perplexity":
                loss = record.get(f"{prefix}loss")
                if isinstance(loss, float) and loss < 80:  # exp(80) is 5e34: not a number anyone reads
                    parts.append(f"{prefix}perplexity {math.exp(loss):.2f}")
            elif f"{prefix}{key}" in record:
                parts.append(f"{prefix}{key} {record[f'{prefix}{key}']:.4f}")
        return "".join(f" {p}" for p in parts)

    def start_progress(self, total: int, description: str, completed: int = 0) -> None:
        if not self.active:
            return
        from rich.console import Console

        console = Console(stderr=True)
        if not console.is_terminal:
            self._lines = {"description": description, "total": total, "t0": time.perf_counter(), "done": completed}
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeRemainingColumn(),
                console=console,
            )
            self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=completed, loss="-", tps="-")

    def log(self, record: dict) -> None:
        if not self.active:
            return
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        reporter().add("metric", record)  # to `scaletune serve` when it watches this run
        # Not charted in TensorBoard / W&B / MLflow: the step (their x axis) and the constant total_steps.
        scalars = {
            _sink_key(k): v
            for k, v in record.items()
            if isinstance(v, (int, float)) and k not in ("step", "total_steps")
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])
        if self._mlflow is not None:
            self._mlflow.log(scalars, record["step"])
        if "loss" in record and self._progress is not None:
            self._progress.update(
                self._task,
                completed=record["stage_step"],
                loss=f"{record['loss']:.4f}{self._headline_text(record)}",
                tps=f"{record['tokens_per_s']:,.0f}",
            )
        elif "loss" in record and self._lines is not None:
            print0(self._progress_line(record))
        elif "eval_loss" in record:
            print0(
                f"[scaletune] step {record['step']} eval_loss {record['eval_loss']:.4f}{self._headline_text(record, 'eval_')}"
            )

    def _progress_line(self, record: dict) -> str:
        lines = self._lines
        assert lines is not None
        done, total = record["stage_step"], lines["total"]
        rate = (time.perf_counter() - lines["t0"]) / max(done - lines["done"], 1)
        eta = time.strftime("%H:%M:%S", time.gmtime(rate * (total - done)))
        return (
            f"[scaletune] {lines['description']} {done}/{total} loss {record['loss']:.4f}{self._headline_text(record)} "
            f"lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:,.0f} tok/s eta {eta}"
        )

    def close(self, outcome: Outcome = "finished") -> None:
        """Flush and close every sink; `outcome` is how the run ended (MLflow's run status)."""
        if self.active:
            reporter().flush()
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()
        if self._mlflow is not None:  # after the file is complete: it is one of the artifacts
            self._mlflow.close(outcome)
        sys.stderr.flush()


def _start_wandb(cfg: Config, run_dir: Path):
    """`wandb.init` for this run: files under `run_dir/wandb`, the resolved config with secret-looking
    values redacted; a resumed run continues the W&B run its first start created."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError("logging.wandb needs the wandb package: pip install 'scaletune[wandb]'") from None
    w = cfg.logging.wandb
    assert w is not None
    folder = run_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / WANDB_ID
    run_id = id_file.read_text().strip() if id_file.is_file() and cfg.training.resume else None
    run = wandb.init(
        project=w.project,
        entity=w.entity,
        name=w.name,
        group=w.group,
        tags=w.tags or None,
        mode=w.mode,
        dir=str(run_dir),
        config=redacted(cfg),
        id=run_id,
        resume="allow" if run_id else None,
    )
    id_file.write_text(run.id + "\n")
    return run


#: Keys of preference objectives' lines (issue 24) drawn in loss.png's second panel.
PREFERENCE_KEYS = ("reward_accuracy", "eval_reward_accuracy", "reward_margin", "eval_reward_margin")


def _series(history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]


def loss_figure(history: list[dict]) -> Any:
    """The figure of loss.png: training loss per step and eval loss where measured; for runs
    whose lines carry reward metrics (DPO, IPO, ORPO, KTO, SimPO), a second panel below with
    reward accuracy (train and eval, left axis, 0..1) and reward margin (right axis) per step.
    An SFT run's figure is the loss panel alone. The caller closes it (`plt.close`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preference = any(_series(history, k) for k in PREFERENCE_KEYS)
    if preference:
        fig, (ax, acc_ax) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, height_ratios=(4, 3))
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    train, ev = _series(history, "loss"), _series(history, "eval_loss")
    if train:
        ax.plot(*zip(*train), label="train loss")
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval loss")
    if not preference:  # the panel below names the shared step axis
        ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss" if preference else "mean token loss")  # a preference loss is per pair
    ax.grid(alpha=0.3)
    ax.legend()
    if preference:
        _reward_panel(acc_ax, history)
    fig.tight_layout()
    return fig


MARGIN_STYLES = (("reward_margin", "--", "train reward margin"), ("eval_reward_margin", "s--", "eval reward margin"))
MARGIN_COLOR = {"train reward margin": "tab:red", "eval reward margin": "tab:purple"}


def _reward_panel(acc_ax: Any, history: list[dict]) -> None:
    """Reward accuracy on `acc_ax` (fixed 0..1, so runs compare by eye) and the margin, which
    is unbounded and in reward units, on a twin axis at the right; one legend for both."""
    handles = []
    for key, style, label in (("reward_accuracy", "-", "train"), ("eval_reward_accuracy", "o-", "eval")):
        points = _series(history, key)
        if points:
            handles += acc_ax.plot(*zip(*points), style, label=f"{label} reward accuracy")
    acc_ax.set_ylim(-0.02, 1.02)
    acc_ax.set_xlabel("optimizer step")
    acc_ax.set_ylabel("reward accuracy")
    acc_ax.grid(alpha=0.3)
    margins = [(k, s, lbl) for k, s, lbl in MARGIN_STYLES if _series(history, k)]
    if margins:
        margin_ax = acc_ax.twinx()
        for key, style, label in margins:
            handles += margin_ax.plot(*zip(*_series(history, key)), style, color=MARGIN_COLOR[label], label=label)
        margin_ax.set_ylabel("reward margin (chosen - rejected)")
    acc_ax.legend(handles=handles, loc="best", fontsize="small", framealpha=0.8)


def plot_losses(history: list[dict], path: Path) -> None:
    """loss.png (:func:`loss_figure`) from the records of metrics.jsonl."""
    import matplotlib.pyplot as plt

    fig = loss_figure(history)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> None:
    """Drop lines past `step` that a crashed run logged, so a resumed curve continues without a seam."""
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    if path.is_file():
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def report_memory(strategy: Any, spec: RunSpec, predicted: dict | None, rollout: dict | None = None) -> None:
    """Every rank measures what it holds (`Strategy.memory_breakdown`, and `rollout`: an online
    stage's generation, `StageObjectives.rollout_memory`); rank 0 writes `memory.json` (all ranks)
    and `plan.json` (the planner's prediction for this run's strategy) and prints them side by side.
    A collective."""
    import torch.distributed as dist

    env = spec.env
    mine = {**strategy.memory_breakdown(), **(rollout or {})}
    ranks = [mine]
    if dist.is_initialized() and env.world_size > 1:
        ranks = [None] * env.world_size
        dist.all_gather_object(ranks, mine)
    if not env.is_main:
        return
    run_dir = spec.run_dir
    (run_dir / "memory.json").write_text(json.dumps({"ranks": ranks}, indent=2) + "\n")
    if predicted is None:
        print0("[scaletune] no memory plan for this run (a layout the planner does not model)")
        return
    (run_dir / "plan.json").write_text(json.dumps(predicted, indent=2) + "\n")
    per_rank = predicted["per_rank_bytes"]
    stage = f", stage {predicted['stage']}" if predicted.get("stage") else ""
    entry = predicted["name"] + (" (a whole replica, as one rank holds)" if spec.strategy == "single" else "")
    lines = [f"[scaletune] memory (MiB) of strategy {spec.strategy}{stage}: the plan's {entry} vs measured on rank 0:"]
    for key in ("params", "grads", "optimizer", *(["kv_cache"] if "kv_cache" in mine else [])):
        lines.append(f"[scaletune]   {key:<10} {per_rank[key] / 2**20:>10.1f} {mine[key] / 2**20:>10.1f}")
    peak = "n/a (no allocator on CPU)" if mine["peak_device"] is None else f"{mine['peak_device'] / 2**20:.1f}"
    lines.append(f"[scaletune]   {'total':<10} {per_rank['total'] / 2**20:>10.1f}  peak device: {peak}")
    print0("\n".join(lines))

"""Metrics of a run: `metrics.jsonl`, TensorBoard and the progress bar (rank 0 only; a no-op logger on
other ranks), and `loss.png` drawn from the metrics file."""

from __future__ import annotations

import json
from pathlib import Path

from scaletune.env import DistributedEnv, print0
from scaletune.report import reporter


class RunLogger:
    """metrics.jsonl, TensorBoard and the progress bar; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, env: DistributedEnv, *, tensorboard: bool) -> None:
        self.active = env.is_main
        self._tb = None
        self._file = None
        self._progress = None
        if not self.active:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
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
        reporter().add("metric", record)  # to `scaletune serve` when it watches this run
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step",):
                    self._tb.add_scalar(f"{'eval' if k.startswith('eval') else 'train'}/{k}", v, record["step"])
        if self._progress is not None and "loss" in record:
            self._progress.update(
                self._task,
                completed=record["stage_step"],
                loss=f"{record['loss']:.4f}",
                tps=f"{record['tokens_per_s']:,.0f}",
            )
        elif "eval_loss" in record:
            print0(f"[scaletune] step {record['step']} eval_loss {record['eval_loss']:.4f}")

    def close(self) -> None:
        if self.active:
            reporter().flush()
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


def write_memory_report(run_dir: Path, ranks: list[dict], predicted: dict | None, strategy: str) -> None:
    """`memory.json` (what every rank measured after its first optimizer step) and `plan.json` (the
    planner's prediction for the run's strategy, when it models it), printed side by side."""
    mine = ranks[0]
    (run_dir / "memory.json").write_text(json.dumps({"ranks": ranks}, indent=2) + "\n")
    if predicted is None:
        print0("[scaletune] no memory plan for this run (a layout the planner does not model)")
        return
    (run_dir / "plan.json").write_text(json.dumps(predicted, indent=2) + "\n")
    per_rank = predicted["per_rank_bytes"]
    lines = [
        f"[scaletune] memory per rank (MiB) of strategy {strategy}: planned (plan entry "
        f"{predicted['name']}) vs measured on rank 0:"
    ]
    for key in ("params", "grads", "optimizer"):
        lines.append(f"[scaletune]   {key:<10} {per_rank[key] / 2**20:>10.1f} {mine[key] / 2**20:>10.1f}")
    peak = "n/a (no allocator on CPU)" if mine["peak_device"] is None else f"{mine['peak_device'] / 2**20:.1f}"
    lines.append(f"[scaletune]   {'total':<10} {per_rank['total'] / 2**20:>10.1f}  peak device: {peak}")
    print0("\n".join(lines))

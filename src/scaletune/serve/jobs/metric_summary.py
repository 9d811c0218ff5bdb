"""A run's metrics lines summed up for comparing runs: the metrics it logged and the last value of
each, the best eval loss, its steps, tokens and training time (`GET /api/jobs/{id}/metrics/summary`,
the compare page's table)."""

from __future__ import annotations

from typing import Any

#: Keys of a metrics line that say where and when it was logged, or what the run used: not metrics
#: to chart or compare (the summary's steps, tokens and elapsed_s come from some of them).
NOT_METRICS = frozenset(
    {
        "step",
        "stage",
        "stage_step",
        "epoch",
        "total_steps",
        "elapsed_s",
        "tokens",
        "memory_bytes",
        "memory_max_bytes",
        "memory_of",
        "gpu_util",
        "skipped",
    }
)
#: How the service keeps a non-finite value of a line (records.json_safe): a value, not a gap.
NON_FINITE = ("NaN", "Infinity", "-Infinity")


def is_value(v: Any) -> bool:
    """A metric's value: a number (not a bool) or a non-finite one kept as its name."""
    return (isinstance(v, int | float) and not isinstance(v, bool)) or v in NON_FINITE


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of a run's metrics lines, in the order the service keeps them (by step; a train
    and an eval line at one step are two lines). A metric the run never logged is absent from
    `keys` and `final`, and a total it has nothing for is None: never 0.

    Returns:
        keys: the metrics its lines carry (train keys and `eval_*` keys), sorted.
        final: each metric's last logged value.
        best_eval_loss: the lowest finite `eval_loss`.
        steps: the last logged step.
        tokens: the non-padding tokens trained: each train line's `tokens` (that step's) times the
            steps since the line before, so exact at `log_every: 1` and an estimate above it
            (`tokens_estimated`).
        elapsed_s: the training time the lines tell: the last `elapsed_s` of each process (it
            restarts at a resume), summed.
    """
    final: dict[str, Any] = {}
    for line in lines:
        final.update({k: v for k, v in line.items() if k not in NOT_METRICS and is_value(v)})
    evals = [v for line in lines if "eval_loss" in line and is_value(v := line["eval_loss"]) and v not in NON_FINITE]
    train = [line for line in lines if "eval_loss" not in line and isinstance(line.get("step"), int)]
    tokens, estimated, before = None, False, 0
    for line in train:
        if isinstance(line.get("tokens"), int):
            gap = max(line["step"] - before, 1)
            tokens, estimated = (tokens or 0) + line["tokens"] * gap, estimated or gap > 1
        before = line["step"]
    steps = [line["step"] for line in lines if isinstance(line.get("step"), int)]
    return {
        "keys": sorted(final),
        "final": final,
        "best_eval_loss": min(evals) if evals else None,
        "steps": max(steps) if steps else None,
        "tokens": tokens,
        "tokens_estimated": estimated,
        "elapsed_s": elapsed(lines),
    }


def elapsed(lines: list[dict[str, Any]]) -> float | None:
    """The sum over the run's processes of each one's last `elapsed_s` (a value lower than the one
    before it starts another process: a resume); None when no line has one."""
    times = [float(t) for line in lines if is_value(t := line.get("elapsed_s")) and t not in NON_FINITE]
    if not times:
        return None
    total = 0.0
    for before, after in zip(times, times[1:]):
        if after < before:
            total += before
    return round(total + times[-1], 3)

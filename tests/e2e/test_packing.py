"""Packing trained end to end through `scaletune train`, single-process and under DDP at world size
2, against the unpacked run of the same examples.

Why the two runs must agree: every optimizer step here takes the WHOLE training set as its global
batch (global_batch_size = the number of rows: packed rows in one run, one example per row in the
other), so both runs see exactly the same examples at every step, only grouped into rows
differently. The step's loss is the summed token loss of the global batch divided by its target
tokens, which does not depend on how examples are grouped into rows, micro-batches or ranks, as
long as packed examples cannot attend to each other and restart their positions (what packing
promises). Same loss means same gradient, same update, same weights: the loss and gradient norm of
every step, the eval loss of the final weights (on packed vs unpacked eval rows) and the tokens
counted per step must match, up to float summation order. Attention leaking across packed
examples, wrong positions, or padding counted as tokens would break this by orders of magnitude
more than the tolerance.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import assert_same_steps, make_config, metrics, steps, train

# 24 Alpaca records, 6 held out for eval: 18 training examples, packed into 16 rows of <= 128 tokens.
RECORDS, DATA = 24, {"max_seq_length": 128, "eval_fraction": 0.25}
MICRO = 2
REL = 1e-5


def rows_of(tiny_model_dir: Path, tmp_path: Path, packing: bool) -> tuple[int, int]:
    """(training rows, training examples) of the test's data: only to size the global batch."""
    from transformers import AutoTokenizer

    from scaletune.config import load_config
    from scaletune.data import build_datasets

    cfg = packing_config(tiny_model_dir, tmp_path / "sizing", packing, global_batch=MICRO * 2)
    data = load_config(None, data=cfg).data
    bundle = build_datasets(data, AutoTokenizer.from_pretrained(tiny_model_dir), seed=cfg["seed"], cache_dir=tmp_path)
    return len(bundle.train), bundle.stats["train_examples"]


def packing_config(
    model_dir: Path, out: Path, packing: bool, global_batch: int, world: int = 1, attn: str | None = None
) -> dict:
    cfg = make_config(
        model_dir,
        out,
        training={
            "global_batch_size": global_batch,
            "micro_batch_size": MICRO,
            "max_steps": 4,
            "warmup_steps": 0,
            "save_every": 0,
            "eval_every": 0,  # the eval set is evaluated once, after the last step
        },
        distributed={"strategy": "ddp" if world > 1 else "single", "num_processes": world},
    )
    cfg["data"].update(DATA, packing=packing)
    cfg["data"]["train"]["max_samples"] = RECORDS
    # Unwritten (the base config writes sdpa), so scaletune chooses the attention for packed rows as
    # it does for a user; written, it is kept.
    cfg["model"].pop("attn_implementation")
    if attn is not None:
        cfg["model"]["attn_implementation"] = attn
    return cfg


@pytest.fixture(scope="module")
def packing_runs(tiny_model_dir, module_tmp_path):
    """`run(packing, world)` -> run directory: one full-batch run per combination, once per module."""
    tmp = module_tmp_path
    packed_rows, examples = rows_of(tiny_model_dir, tmp, packing=True)
    unpacked_rows, _ = rows_of(tiny_model_dir, tmp, packing=False)
    assert unpacked_rows == examples and packed_rows < examples, "packing must put several examples in a row"
    assert packed_rows % (MICRO * 2) == 0 and unpacked_rows % MICRO == 0, (
        f"{packed_rows} packed / {unpacked_rows} unpacked rows: choose DATA so both fill whole micro-batches"
    )
    cache: dict[tuple[bool, int, str | None], Path] = {}

    def run(packing: bool, world: int = 1, attn: str | None = None) -> Path:
        """The run directory; its `scaletune train` stderr is in `said[run directory]`."""
        if (packing, world, attn) not in cache:
            name = f"{'packed' if packing else 'unpacked'}-w{world}{f'-{attn}' if attn else ''}"
            rows = packed_rows if packing else unpacked_rows
            cfg = packing_config(tiny_model_dir, tmp / name, packing, global_batch=rows, world=world, attn=attn)
            proc = train(cfg, tmp, name=f"{name}.yaml")
            # One step per epoch: every step is the whole training set, in `rows` rows.
            assert re.search(rf"stage main: {rows} sequences, 1 steps per epoch", proc.stderr), proc.stderr[-3000:]
            assert f"{examples} examples (" in proc.stderr and f", {rows} rows," in proc.stderr
            cache[packing, world, attn] = tmp / name
            said[tmp / name] = proc.stderr
        return cache[packing, world, attn]

    said: dict[Path, str] = {}
    run.said = said
    return run


def eval_loss(run: Path) -> float:
    (last,) = [m["eval_loss"] for m in metrics(run) if "eval_loss" in m]
    return last


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)], ids=["single", "ddp-2"])
def test_packed_training_equals_unpacked(packing_runs, world):
    """Packed rows (single process, or DDP over 2 ranks) train exactly as the unpacked examples do
    on one process: per step loss and gradient norm, tokens, and the final eval loss (module
    docstring: why this holds by construction)."""
    packed, unpacked = packing_runs(True, world), packing_runs(False)
    what = f"packed ({'ddp, 2 ranks' if world == 2 else 'single'}) vs unpacked"
    assert_same_steps(packed, unpacked, REL, what)
    assert [m["tokens"] for m in steps(packed)] == [m["tokens"] for m in steps(unpacked)], what
    got, want = eval_loss(packed), eval_loss(unpacked)
    assert abs(got - want) <= REL * want, f"{what}: eval loss {got} vs {want}"
    # Every step sees the same data (the whole set), so here the loss moves by training alone:
    # the runs are compared after real updates, not on four copies of the initial loss.
    assert steps(unpacked)[-1]["loss"] < steps(unpacked)[0]["loss"] - 0.05


def test_packed_attention_is_chosen_printed_and_equals_dense_sdpa(packing_runs):
    """`scaletune train` with data.packing and the attention left at its default prints, once, the
    attention it chose for packed rows and why (flex_attention with a block mask on CUDA; sdpa on
    the CPU, where torch has no flex_attention backward); its steps and eval loss equal, within
    1e-5, those of the dense-mask SDPA path asked for by writing model.attn_implementation: sdpa."""
    import torch

    chosen, dense = packing_runs(True), packing_runs(True, attn="sdpa")
    said = packing_runs.said[chosen]
    lines = [line for line in said.splitlines() if "attention for packed rows:" in line]
    if torch.cuda.is_available():
        assert lines == [
            "[scaletune] attention for packed rows: flex_attention, a block mask built once per micro-batch "
            "(default on CUDA; model.attn_implementation: sdpa keeps the dense mask)"
        ], said[-3000:]
    else:
        assert len(lines) == 1 and re.fullmatch(
            r"\[scaletune\] attention for packed rows: sdpa with a dense block-diagonal mask "
            r"\(torch \S+ has no flex_attention backward on the CPU\)",
            lines[0],
        ), said[-3000:]
    assert "attention for packed rows: sdpa (model.attn_implementation)" in packing_runs.said[dense]
    assert_same_steps(chosen, dense, REL, "packed: chosen attention vs dense-mask sdpa")
    got, want = eval_loss(chosen), eval_loss(dense)
    assert abs(got - want) <= REL * want, f"eval loss {got} vs {want}"

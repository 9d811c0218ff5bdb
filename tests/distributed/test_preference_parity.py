"""Preference training (issue 24) is the same computation on 1 or 2 ranks: DPO at world size 2 under
DDP, FSDP2 and DeepSpeed ZeRO-2/3, with each reference mode, reproduces the single-process loss and gradient norm at every step (fp32), the
eval set (5 pairs: uneven over 2 ranks) included; one micro-batch of 4 pairs equals 4 of 1; and an
SFT -> DPO run resumed inside its DPO stage continues as the uninterrupted run. DDP with the `base`
reference starts through `scaletune train` at world size 2 (re-executed under torchrun); the other
runs' command lines run one after another in the ranks of one torchrun per world size.

Data: 24 training and 5 held-out pairs from the real Alpaca records (chosen = the record's output,
rejected = the output of the record 7 places on), rendered with the tiny model's ChatML template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import (
    ALPACA_5000,
    GRAD_REL,
    LORA,
    assert_close,
    assert_same_steps,
    make_config,
    metrics,
    steps,
    train,
    train_batch,
)

pytestmark = pytest.mark.distributed

REL = 1e-4


def _pairs(records: list[dict], shift: int) -> list[dict]:
    n = len(records)
    return [
        {"prompt": r["instruction"], "chosen": r["output"], "rejected": records[(i + shift) % n]["output"]}
        for i, r in enumerate(records)
    ]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory) -> tuple[Path, Path]:
    records = json.loads(ALPACA_5000.read_text())
    folder = tmp_path_factory.mktemp("pairs")
    out = []
    for name, part in (("train", records[:24]), ("eval", records[100:105])):
        path = folder / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(p) for p in _pairs(part, 7)) + "\n")
        out.append(path)
    return out[0], out[1]


def _evals(run: Path) -> list[dict]:
    return [m for m in metrics(run) if "eval_loss" in m]


def _assert_parity(run: Path, ref: Path, what: str, grad_rel: float) -> None:
    assert_same_steps(run, ref, REL, what, grad_rel=grad_rel)
    for key in ("reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected"):
        got, want = [m[key] for m in steps(run)], [m[key] for m in steps(ref)]
        assert_close([abs(x) + 1 for x in got], [abs(x) + 1 for x in want], REL, f"{what}: {key}")
    got, want = _evals(run), _evals(ref)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [0, 3]
    for key in ("eval_loss", "eval_reward_margin", "eval_logp_chosen"):
        assert_close([abs(m[key]) + 1 for m in got], [abs(m[key]) + 1 for m in want], REL, f"{what}: {key}")


ENGINES = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}
# reference mode -> the model section it trains (`base` needs adapters to switch off)
MODES = {"precomputed": {}, "base": LORA, "model": {}}
SINGLE = {"strategy": "single", "num_processes": 1}


# Each engine and each reference mode, `base` (the policy with its adapters off) whole and sharded
# (43-115 s a case on 2 cores). The other cells of the 3 x 4 product add no code path of their own:
# `precomputed` reads a table computed before the engine sees a batch (held against TRL in
# tests/e2e/test_preference_vs_trl.py), and the `model` reference under each of the four engines is
# held against the unsharded forward, with its bytes per rank, in tests/distributed/test_reference_model.py.
CASES = [("base", "ddp"), ("base", "zero3"), ("precomputed", "zero3"), ("model", "fsdp"), ("model", "zero2")]


@pytest.mark.parametrize(("mode", "engine"), CASES)
def test_dpo_parity_at_world_size_2(mode, engine, dpo_runs):
    ref, run = dpo_runs[f"single-{mode}"], dpo_runs[f"{engine}-{mode}"]
    first = steps(ref)[0]
    # Before the first update the policy is the reference: every reward is 0, the loss log 2.
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5) and first["reward_margin"] == pytest.approx(0, abs=1e-5)
    # A full fine-tune's gradient norm sums the head's float32 gradient per shard under FSDP and ZeRO
    # (tests/helpers.py GRAD_REL); DDP and every LoRA run hold it to REL.
    grad_rel = REL if (engine == "ddp" or mode == "base") else GRAD_REL
    _assert_parity(run, ref, f"dpo reference {mode} under {engine} at world size 2 vs single process", grad_rel)
    assert [m["tokens"] for m in steps(run)] == [m["tokens"] for m in steps(ref)]
    # The policy trained: by the last step the training pairs' margin is no longer 0.
    assert abs(steps(run)[-1]["reward_margin"]) > 1e-3
    # What each rank holds for the reference, measured from its tensors (memory.json): nothing for
    # base and precomputed; for model a copy, whole under ddp/ZeRO-2, half under fsdp/ZeRO-3.
    whole = json.loads((ref / "memory.json").read_text())["ranks"][0]["reference"]
    assert (whole > 0) == (mode == "model")
    for rank in json.loads((run / "memory.json").read_text())["ranks"]:
        if mode != "model":
            assert rank["reference"] == 0, (mode, engine, rank)
        elif engine in ("ddp", "zero2"):  # whole on every rank, as these engines keep the policy
            assert rank["reference"] == whole, (engine, rank, whole)
        else:  # sharded: half of it per rank (ZeRO-3 keeps small persistent parameters whole)
            assert 0.45 * whole < rank["reference"] < 0.6 * whole, (engine, rank, whole)


def test_micro_batch_split_does_not_change_the_step(dpo_runs):
    """One micro-batch of 4 pairs per step equals 4 micro-batches of 1 (gradient accumulation)."""
    assert_same_steps(dpo_runs["single-4x1"], dpo_runs["single-1x4"], REL, "4 micro-batches of 1 pair vs 1 of 4")


OBJECTIVES = ["ipo", "orpo", "simpo", "kto"]


@pytest.fixture(scope="module")
def kto_files(tmp_path_factory) -> tuple[Path, Path]:
    """The same records as unpaired KTO rows: two in three desirable (the record's output), the third
    undesirable (the output of the record 7 places on)."""
    folder = tmp_path_factory.mktemp("kto")
    records = json.loads(ALPACA_5000.read_text())
    out = []
    for name, part in (("train", records[:24]), ("eval", records[100:105])):
        rows = [
            {
                "prompt": r["instruction"],
                "completion": r["output"] if i % 3 else part[(i + 7) % len(part)]["output"],
                "label": bool(i % 3),
            }
            for i, r in enumerate(part)
        ]
        path = folder / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
        out.append(path)
    return out[0], out[1]


def objective_stages(kto_files: tuple[Path, Path]) -> list[dict]:
    """One curriculum stage per objective, 3 steps each, in OBJECTIVES' order: each objective's
    steps and evals are those of its stage, so one run per world size proves all four (a run each
    would start 8 processes more for the same proof). Each stage starts from the policy the stage
    before left and precomputes its reference from it."""
    kto = {
        "train": {"path": str(kto_files[0]), "format": "kto"},
        "eval": {"path": str(kto_files[1]), "format": "kto"},
    }
    return [
        {
            "name": objective,
            "training": {"objective": objective, "max_steps": 3},
            **({"data": kto} if objective == "kto" else {}),
        }
        for objective in OBJECTIVES
    ]


def dpo_base(pair_files: tuple[Path, Path]) -> dict:
    """Every run's config before its own sections: DPO on the pairs, 3 steps of 8 pairs in
    micro-batches of 2, an eval before the first step and at the end."""
    train_file, eval_file = pair_files
    return {
        "data": {
            "train": {"path": str(train_file), "format": "preference"},
            "eval": {"path": str(eval_file), "format": "preference"},
            "max_seq_length": 64,
        },
        "training": {
            "objective": "dpo",
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "max_steps": 3,
            "warmup_steps": 0,
            "learning_rate": 1e-3,
            "eval_every": 0,
            "eval_on_start": True,
            "save_every": 0,
        },
    }


def module_runs(kto_files: tuple[Path, Path]) -> dict[str, dict]:
    """Every run of this module by name, its sections over :func:`dpo_base`."""
    runs: dict[str, dict] = {}
    for mode, engine in CASES:
        pref = {"preference": {"beta": 0.1, "reference": mode}}
        runs[f"single-{mode}"] = {"model": MODES[mode], "distributed": SINGLE, "training": pref}
        two = {**ENGINES[engine], "num_processes": 2}
        runs[f"{engine}-{mode}"] = {"model": MODES[mode], "distributed": two, "training": pref}
    no_eval = {"eval": None}
    for name, micro in (("single-1x4", 4), ("single-4x1", 1)):
        split = {"global_batch_size": 4, "micro_batch_size": micro, "eval_on_start": False}
        runs[name] = {"distributed": SINGLE, "training": split, "data": no_eval}
    training = {"preference": {"beta": 0.1, "reference": "precomputed"}}
    stages = objective_stages(kto_files)
    runs["single-objectives"] = {"distributed": SINGLE, "training": training, "stages": stages}
    ddp = {"strategy": "ddp", "num_processes": 2}
    runs["ddp-objectives"] = {"distributed": ddp, "training": training, "stages": stages}
    return runs


# Through the plain command (`scaletune train` of 2 processes, re-executed under torchrun); the
# others' command lines one after another in the ranks of one torchrun per world size
# (tests/helpers.py train_batch): their subject is the objective's arithmetic.
USER_RUN = "ddp-base"


@pytest.fixture(scope="module")
def dpo_runs(tiny_model_dir, tmp_path_factory, pair_files, kto_files) -> dict[str, Path]:
    """Every run of :func:`module_runs`, trained: name -> run directory."""
    folder = tmp_path_factory.mktemp("dpo")
    configs = {
        name: make_config(tiny_model_dir, folder / name, dpo_base(pair_files), **sections)
        for name, sections in module_runs(kto_files).items()
    }
    train(configs[USER_RUN], folder, name=f"{USER_RUN}.yaml")
    train_batch({name: cfg for name, cfg in configs.items() if name != USER_RUN}, folder / "configs")
    yield {name: folder / name for name in configs}
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_other_objectives_parity_under_ddp(objective, dpo_runs):
    """IPO, ORPO, SimPO and KTO (its KL pass over the whole global batch) under DDP at world size 2,
    one stage each of the same two runs (world sizes 1 and 2)."""
    ref, run = dpo_runs["single-objectives"], dpo_runs["ddp-objectives"]
    assert [m["stage"] for m in steps(ref)] == [s for s in OBJECTIVES for _ in range(3)]

    def mine(lines: list[dict]) -> list[dict]:
        return [m for m in lines if m["stage"] == objective]

    got, want = mine(steps(run)), mine(steps(ref))
    what = f"{objective} under ddp at world size 2 vs single process"
    assert [m["step"] for m in got] == [m["step"] for m in want] and len(got) == 3, what
    assert_close([m["loss"] for m in got], [m["loss"] for m in want], REL, f"{what}: loss")
    assert_close([m["grad_norm"] for m in got], [m["grad_norm"] for m in want], REL, f"{what}: grad_norm")
    got_evals, want_evals = mine(_evals(run)), mine(_evals(ref))
    assert got_evals and [m["step"] for m in got_evals] == [m["step"] for m in want_evals], what
    assert_close([m["eval_loss"] for m in got_evals], [m["eval_loss"] for m in want_evals], REL, f"{objective} eval")
    if objective == "kto":
        assert all("kl" in m for m in got)

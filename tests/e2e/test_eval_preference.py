"""`scaletune eval RUN --data PAIRS --format preference` (issue 24) against the trainer's own
evaluation of the same held-out pairs (an independent code path: the loop's all-reduced eval with
its own batching, reference tables and stats): real tiny DPO runs, LoRA after an SFT stage
(reference: the adapter disabled), full fine-tune (reference: the run's model.name_or_path) and SimPO (no reference: its
length-normalised rewards), and the lr=0 control, whose policy is its reference: margin 0 and no
pair correct, since a tie is not a win (as the trainer counts it)."""

from __future__ import annotations

import json
import math

import matplotlib.image
import pytest

from tests.helpers import ALPACA_5000, REPO_ROOT, make_config, metrics, run_cli, train

PAIRS = REPO_ROOT / "examples" / "data" / "alpaca_pairs.jsonl"
HELDOUT = REPO_ROOT / "examples" / "data" / "alpaca_pairs_heldout.jsonl"
BETA = 0.25  # not the default 0.1: the eval must take the run's
LORA = {"lora": {"r": 8, "alpha": 16, "dropout": 0.0}}


def dpo_config(model, out, held, **training):
    return make_config(
        model,
        out,
        data={
            "train": {"path": str(PAIRS), "format": "preference", "max_samples": 32},
            "eval": {"path": str(held), "format": "preference"},
        },
        training={
            "objective": "dpo",
            "preference": {"beta": BETA},
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "max_steps": 4,
            "eval_every": 2,
            "save_every": 0,
            "learning_rate": 5e-3,
            **training,
        },
    )


@pytest.fixture(scope="module")
def held(module_tmp_path):
    path = module_tmp_path / "heldout.jsonl"
    path.write_text("".join(HELDOUT.read_text().splitlines(keepends=True)[:16]))
    return path


def run_dpo(tiny_model_dir, tmp, held, name, model=None, **training):
    cfg = dpo_config(tiny_model_dir, tmp / name, held, **training)
    if model is not None:
        cfg["model"].update(model)
    train(cfg, tmp, name=f"{name}.yaml")
    return tmp / name


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, module_tmp_path, held):
    """SFT then DPO in one LoRA run (issue 24's curriculum): 2 SFT steps on Alpaca records, then 4
    DPO steps whose stage reads its pairs at its own max_seq_length (48: one held-out pair keeps no
    trained token and is dropped, by the trainer and by the eval alike)."""
    cfg = dpo_config(tiny_model_dir, module_tmp_path / "lora", held, objective="sft", max_steps=6)
    cfg["model"].update(LORA)
    pairs, cfg["data"] = cfg["data"], {"train": {"path": str(ALPACA_5000), "max_samples": 16}, "max_seq_length": 64}
    cfg["stages"] = [
        {"name": "sft", "training": {"max_steps": 2}},
        {"name": "dpo", "training": {"objective": "dpo", "max_steps": 4}, "data": {**pairs, "max_seq_length": 48}},
    ]
    proc = train(cfg, module_tmp_path, name="lora.yaml")
    (module_tmp_path / "lora.console").write_text(proc.stderr)  # what the user saw
    return module_tmp_path / "lora"


@pytest.fixture(scope="module")
def control_run(tiny_model_dir, module_tmp_path, held):
    return run_dpo(tiny_model_dir, module_tmp_path, held, "control", LORA, learning_rate=0.0)


@pytest.fixture(scope="module")
def control_eval(control_run, held):
    return evaluate(control_run, held, "--batch-size", "4")


def evaluate(target, held, *extra) -> dict:
    proc = run_cli(["eval", str(target), "--data", str(held), "--format", "preference", "--json", *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def final_eval(run) -> dict:
    return [r for r in metrics(run) if "eval_reward_accuracy" in r][-1]


def test_sft_then_dpo_lora_run_matches_the_trainers_final_eval(lora_run, held):
    want = final_eval(lora_run)
    assert want["stage"] == "dpo" and want["step"] == 6, want
    got = evaluate(lora_run, held)  # 8 pairs per forward; the trainer's eval took 4
    assert (got["pairs"], got["beta"], got["reference"]) == (15, BETA, "adapter"), got
    assert got["reward_accuracy"] == want["eval_reward_accuracy"], (got, want)
    assert abs(got["reward_margin"]) > 1e-3, got  # trained: the comparison is not of zeros
    assert got["reward_margin"] == pytest.approx(want["eval_reward_margin"], abs=1e-5)
    for key in ("logp_chosen", "logp_rejected"):
        assert got[key] == pytest.approx(want[f"eval_{key}"], rel=1e-5), key
    written = json.loads((lora_run / "eval" / got["file"].rsplit("/", 1)[1]).read_text())
    assert written == {k: v for k, v in got.items() if k != "file"}
    # --beta scales the rewards, not the log-probs: the margin in proportion, the order unchanged.
    doubled = evaluate(lora_run, held, "--beta", str(2 * BETA))
    assert doubled["reward_margin"] == pytest.approx(2 * got["reward_margin"], rel=1e-6)
    assert doubled["reward_accuracy"] == got["reward_accuracy"]
    # The run's loss.png has the reward panel below the loss (the unit test reads its axes).
    assert matplotlib.image.imread(lora_run / "loss.png").shape[:2] == (700, 700)


def test_the_console_shows_each_stages_headline_metrics(lora_run):
    """Each step and eval line on the console carries its stage objective's headline metrics beside
    the loss: perplexity for SFT, reward accuracy and margin for DPO (they used to be in
    metrics.jsonl alone). Control: the numbers of metrics.jsonl, perplexity as exp(loss) here."""
    console = (lora_run.parent / "lora.console").read_text()
    totals = {"sft": 2, "dpo": 4}
    seen = {"sft": 0, "dpo": 0, "eval": 0}
    for r in metrics(lora_run):
        if "loss" in r:
            extra = (
                f"perplexity {math.exp(r['loss']):.2f}"
                if r["stage"] == "sft"
                else f"reward_accuracy {r['reward_accuracy']:.4f} reward_margin {r['reward_margin']:.4f}"
            )
            line = f"[scaletune] {r['stage']} {r['stage_step']}/{totals[r['stage']]} loss {r['loss']:.4f} {extra} lr "
            seen[r["stage"]] += 1
        elif "eval_reward_accuracy" in r:
            line = (
                f"[scaletune] step {r['step']} eval_loss {r['eval_loss']:.4f} eval_reward_accuracy "
                f"{r['eval_reward_accuracy']:.4f} eval_reward_margin {r['eval_reward_margin']:.4f}\n"
            )
            seen["eval"] += 1
        else:
            continue
        assert line in console, (line, console[-3000:])
    assert seen == {"sft": 2, "dpo": 4, "eval": seen["eval"]} and seen["eval"] >= 1, seen


def test_lr0_control_has_no_margin_and_counts_ties_as_not_correct(control_run, control_eval):
    want, got = final_eval(control_run), control_eval
    assert abs(got["reward_margin"]) <= 1e-6 and abs(want["eval_reward_margin"]) <= 1e-6, (got, want)
    assert got["reward_accuracy"] == want["eval_reward_accuracy"] == 0.0, (got, want)
    assert abs(got["logp_margin"]) > 1.0, got  # the answers differ; only the rewards tie


def test_model_without_a_run_is_reference_free(tiny_model_dir, control_eval, held, tmp_path):
    args = ["--batch-size", "4", "--max-seq-length", "64", "--output", str(tmp_path)]  # the runs' length
    proc = run_cli(["eval", str(tiny_model_dir), "--data", str(held), "--format", "preference", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| reward_accuracy | n/a |" in proc.stdout and "reference-free" in proc.stdout, proc.stdout
    (written,) = tmp_path.glob("preference-*.json")
    got = json.loads(written.read_text())
    assert got["reference"] is None and got["reward_accuracy"] is None and got["reward_margin"] is None, got
    for key in ("logp_chosen", "logp_rejected", "logp_margin", "logp_accuracy"):  # lr 0: the base's log-probs
        assert got[key] == pytest.approx(control_eval[key], rel=1e-6), key


def test_full_finetune_is_compared_with_its_starting_model(tiny_model_dir, module_tmp_path, held):
    run = run_dpo(tiny_model_dir, module_tmp_path, held, "full", max_steps=2)
    want = final_eval(run)
    got = evaluate(run, held)
    assert got["reference"] == str(tiny_model_dir), got
    assert got["reward_accuracy"] == want["eval_reward_accuracy"], (got, want)
    assert abs(got["reward_margin"]) > 1e-3, got
    assert got["reward_margin"] == pytest.approx(want["eval_reward_margin"], abs=1e-5)
    # --reference the run itself: the policy against itself, as the lr=0 control.
    same = evaluate(run, held, "--reference", str(run))
    assert abs(same["reward_margin"]) <= 1e-6 and same["reward_accuracy"] == 0.0, same


def test_bad_arguments_are_refused_together(tiny_model_dir, held):
    proc = run_cli(["eval", str(tiny_model_dir), "--data", str(held), "--beta", "0", "--reference", "x"])
    assert proc.returncode == 2, proc.stderr
    for text in ("--beta 0.0: must be above 0", "--reference applies to --format preference"):
        assert text in proc.stderr, proc.stderr
    proc = run_cli(["eval", str(tiny_model_dir), "--data", str(held), "--format", "preference", "--field", "x"])
    assert proc.returncode == 2 and "--field applies to" in proc.stderr, proc.stderr


def test_simpo_run_uses_its_own_reference_free_rewards(tiny_model_dir, module_tmp_path, held):
    run = run_dpo(tiny_model_dir, module_tmp_path, held, "simpo", LORA, objective="simpo", max_steps=2)
    want = final_eval(run)
    got = evaluate(run, held)
    assert (got["objective"], got["reference"]) == ("simpo", None) and "mean log-prob per" in got["rewards"]
    assert got["reward_accuracy"] == want["eval_reward_accuracy"], (got, want)
    assert got["reward_margin"] == pytest.approx(want["eval_reward_margin"], abs=1e-6)
    proc = run_cli(["eval", str(run), "--data", str(held), "--format", "preference", "--reference", str(run)])
    assert proc.returncode == 2 and "whose rewards use no reference model" in proc.stderr, proc.stderr

"""Resume exactly, reshard to another world size, export from sharded checkpoints.

Every run here is the 8-step base config saving at step 4; the runs it resumes from are the
parity runs (tests/distributed/conftest.py trains each once per session), and their resumes are
trained together too (the `resumed` fixture)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.parity_cases import SINGLE, STRATEGIES
from tests.helpers import (
    GRAD_REL,
    LORA,
    SMALL_TOKENIZER,
    assert_same_logits,
    assert_same_steps,
    logits,
    make_config,
    run_cli,
    steps,
    train,
    train_batch,
)

pytestmark = pytest.mark.distributed


EXACT = ["single", "ddp", "fsdp", "zero2"]
RESHARDED = ["fsdp", "zero2", "zero3"]


@pytest.fixture(scope="module")
def resumed(run_once, tiny_model_dir, tmp_path_factory) -> dict[str, tuple]:
    """The resumes of run_once's runs, by name -> (run directory, record): `exact-CASE` from the
    run's step 4 on its own world size; `one-CASE` from the two-rank run's step 4 on one process
    (saving at step 6), `back-CASE` from that step 6 on two again. Each the command line a user
    types, those of one world size one after another in the ranks of one torchrun (the one-process
    resumes first: the two-rank ones read their checkpoints); resumes through the user's command
    are the edge matrix's (tests/distributed/test_edge_matrix.py USER_CASES)."""
    folder = tmp_path_factory.mktemp("resumed")
    runs = {case: run_once(case)[0] for case in {*EXACT, *RESHARDED}}
    configs = {}

    def resume(name: str, checkpoint: Path, dist: dict, **training) -> None:
        training = {"resume": str(checkpoint), **training}
        configs[name] = make_config(tiny_model_dir, folder / name, distributed=dist, training=training)

    for case in EXACT:
        resume(f"exact-{case}", runs[case] / "checkpoints" / "step-4", STRATEGIES[case])
    for case in RESHARDED:
        one = {**STRATEGIES[case], "num_processes": 1}
        resume(f"one-{case}", runs[case] / "checkpoints" / "step-4", one, save_every=2)
        resume(f"back-{case}", folder / f"one-{case}" / "checkpoints" / "step-6", STRATEGIES[case])
    records = train_batch(configs, folder / "configs")
    yield {name: (folder / name, records[name]) for name in configs}
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("case", EXACT)
def test_exact_resume(case, run_once, resumed):
    """Steps 5-8 of a run resumed from step 4 equal the uninterrupted run's within 1e-5."""
    full, _ = run_once(case)
    ckpt = full / "checkpoints" / "step-4"
    progress = json.loads((ckpt / "progress.json").read_text())
    assert progress["step"] == 4 and progress["sample_offset"] == 32 and progress["world_size"] in (1, 2)
    run, proc = resumed[f"exact-{case}"]
    assert f"resumed from {ckpt}" in proc.stderr
    assert [m["step"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [5, 6, 7, 8]
    assert_same_steps(run, full, 1e-5, f"{case}: resumed steps 5-8", first=4)


DROPOUT_LORA = {"lora": {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": "auto"}}
# How far a resume without the RNG lands from the uninterrupted run, at the worst of the resumed
# steps (relative; measured on one process: loss 9.6e-5, grad_norm 1.6e-2): well above the 1e-5 of
# an exact resume.
LOSS_GAP, NORM_GAP = 3e-5, 3e-3


def _dropout_stages(tiny_model_dir, out, **training):
    """Two ranks (ddp), LoRA dropout 0.1, two stages of 4 steps on one continuing cosine; a
    checkpoint at stage one's end (step 4) and inside stage two (step 6)."""
    cfg = make_config(
        tiny_model_dir,
        out,
        model=DROPOUT_LORA,
        distributed=STRATEGIES["ddp"],
        training={"max_steps": 4, "save_every": 6, "keep_last": 3, **training},
    )
    cfg["stages"] = [{"name": "one"}, {"name": "two", "continue_schedule": True, "training": {"max_steps": 4}}]
    return cfg


def test_exact_resume_with_dropout_restores_every_ranks_rng(tiny_model_dir, tmp_path):
    """LoRA dropout 0.1 draws a mask from each rank's torch RNG at every forward, so restoring each
    rank's RNG is observable. On two ranks, resumed at stage one's end (a stage-end checkpoint:
    stage two starts from the checkpoint's RNG and goes on down the schedule) and inside stage two,
    every resumed step equals the uninterrupted two-rank run within 1e-5 (loss, grad norm, lr). The
    control, the mid-stage resume from a copy of the checkpoint without its rng/ folder (the loader
    then leaves the RNG as seeding and loading left it), draws other masks and diverges by far more
    than that tolerance. (Dropout masks are drawn per rank, so these runs equal the uninterrupted
    run of their world size, not one process's; the stage-boundary matrix without dropout is
    tests/distributed/test_edge_matrix.py's.)"""
    import shutil

    # Under torchrun (the RNG is each rank's; the plain command's parent adds nothing here), the run
    # and its two resumes one after another in the ranks of one (tests/distributed/sequential_runs.py).
    full = tmp_path / "run"
    configs = {"run": _dropout_stages(tiny_model_dir, full)}
    for step in (4, 6):
        ckpt = full / "checkpoints" / f"step-{step}"
        configs[f"from-{step}"] = _dropout_stages(tiny_model_dir, tmp_path / f"from-{step}", resume=str(ckpt))
    train_batch(configs, tmp_path / "configs")
    for step in (4, 6):
        assert (full / "checkpoints" / f"step-{step}" / "rng" / "rank-1.pt").is_file()
        assert_same_steps(tmp_path / f"from-{step}", full, 1e-5, f"dropout 0.1, 2 ranks: from step {step}", first=step)
        got, want = steps(tmp_path / f"from-{step}"), steps(full)[step:]
        assert [m["lr"] for m in got] == pytest.approx([m["lr"] for m in want], rel=1e-7)
    no_rng = tmp_path / "no-rng"
    shutil.copytree(full / "checkpoints" / "step-6", no_rng)
    shutil.rmtree(no_rng / "rng")
    control = _dropout_stages(tiny_model_dir, tmp_path / "control", resume=str(no_rng))
    train(control, tmp_path, name="control.yaml", launcher="torchrun")
    got, want = steps(tmp_path / "control"), steps(full)[6:]
    assert [m["step"] for m in got] == [m["step"] for m in want] == [7, 8]
    assert got[0]["loss"] != want[0]["loss"]  # step 7 already runs on other dropout masks
    loss_gap = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, want))
    norm_gap = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(got, want))
    assert loss_gap > LOSS_GAP and norm_gap > NORM_GAP, (
        f"resume without RNG: loss {loss_gap:.1e}, grad_norm {norm_gap:.1e}"
    )


@pytest.mark.parametrize("case", RESHARDED)
def test_reshard_two_to_one_and_one_to_two(case, run_once, resumed):
    """World size 2 -> 1 from step 4 (saving again at step 6), then 1 -> 2 from step 6: the loss
    follows the uninterrupted single-process run within 1e-4 (the gradient norm within GRAD_REL)."""
    ref = run_once("single")[0]
    one, proc = resumed[f"one-{case}"]
    assert "resharded step-4: written by 2 rank(s)" in proc.stderr and "now 1" in proc.stderr
    assert_same_steps(one, ref, 1e-4, f"{case}: 2 -> 1 ranks, steps 5-8", first=4, grad_rel=GRAD_REL)
    back, proc = resumed[f"back-{case}"]
    assert "resharded step-6: written by 1 rank(s)" in proc.stderr and "now 2" in proc.stderr
    assert_same_steps(back, ref, 1e-4, f"{case}: 1 -> 2 ranks, steps 7-8", first=6, grad_rel=GRAD_REL)


@pytest.mark.parametrize("case", ["fsdp", "zero3"])
def test_export_from_sharded_checkpoint(case, run_once, tmp_path):
    """`scaletune export` of the final sharded checkpoint = the single-process model's logits."""
    two, _ = run_once(case)
    ref = run_once("single")[0]
    proc = run_cli(["export", str(two / "checkpoints" / "step-8"), "-o", str(tmp_path / "export")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert_same_logits(logits(tmp_path / "export"), logits(ref / "final"), f"{case} export")


def test_export_merged_lora_equals_base_plus_adapter(run_once, tmp_path):
    run, _ = run_once("single-lora")
    proc = run_cli(["export", str(run), "-o", str(tmp_path / "merged"), "--merge-lora"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    # final/ holds the adapter over the base; the merged export folds it in: same function.
    assert_same_logits(logits(tmp_path / "merged"), logits(run / "final", adapter=True), "merged LoRA")
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged and not any("lora" in k for k in merged)


def test_resume_bad_inputs(run_once, tiny_model_dir, tiny_llama_dir, tmp_path):
    full, _ = run_once("single")
    ckpt = full / "checkpoints" / "step-4"
    # A path that does not exist, a folder that is not a checkpoint: exit 2, nothing written.
    for bad, message in ((tmp_path / "nope", "does not exist"), (tiny_model_dir, "is not a checkpoint")):
        cfg = make_config(tiny_model_dir, tmp_path / "r", training={"resume": str(bad)})
        proc = train(cfg, tmp_path, expect_ok=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "r").exists()
    # Another LoRA shape than the checkpoint's: a config change that cannot resume.
    cfg = make_config(tiny_model_dir, tmp_path / "r", model=LORA, training={"resume": str(ckpt)})
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2 and "model.lora changed" in proc.stderr
    # Another model under the same path name: the first differing tensor is named.
    import shutil

    other = tmp_path / "same-name"
    shutil.copytree(tiny_llama_dir, other)
    saved_cfg = (ckpt / "config.yaml").read_text()
    fake = tmp_path / "ckpt"
    shutil.copytree(ckpt, fake)
    (fake / "config.yaml").write_text(saved_cfg.replace(str(tiny_model_dir), str(other)))
    cfg = make_config(other, tmp_path / "r", training={"resume": str(fake)})
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2 and "tensor model.causal_lm." in proc.stderr, proc.stderr[-2000:]


def test_interrupted_save_keeps_latest_on_previous_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """A save that dies after writing its shards leaves `latest` on the last complete checkpoint
    and the step-N name unused (in process, single strategy, real DCP files)."""
    from scaletune.checkpoint import Progress, latest_checkpoint, save_checkpoint
    from scaletune.config import Config
    from scaletune.env import DistributedEnv
    from scaletune.models import DevicePlacement, prepare_model
    from scaletune.models.loss import CausalLMLoss
    from scaletune.resolve import decide
    from scaletune.strategies import make_strategy

    cfg = Config.model_validate(make_config(tiny_model_dir, tmp_path / "run"))
    env = DistributedEnv(launcher="none")
    strategy = make_strategy(decide(cfg, env))
    model = prepare_model(cfg.model, DevicePlacement(device_map=None, device="cpu", message=None))
    strategy.wrap(CausalLMLoss(model))
    run = tmp_path / "run"

    def progress(step):
        return Progress(
            step=step,
            stage_index=0,
            stage_name="main",
            stage_step=step,
            epoch=0,
            step_in_epoch=step,
            sample_offset=8 * step,
            world_size=1,
            strategy="single",
            checkpoint_format="dcp",
        )

    save_checkpoint(strategy, run, progress(4), cfg, {}, keep_last=2)
    with pytest.raises(RuntimeError, match="interrupted"):
        save_checkpoint(strategy, run, progress(8), cfg, {}, keep_last=2, fail_after_state=True)
    assert latest_checkpoint(run) == run / "checkpoints" / "step-4"
    assert not (run / "checkpoints" / "step-8").exists()
    # The next save at that step cleans the half-written folder and completes.
    save_checkpoint(strategy, run, progress(8), cfg, {}, keep_last=1)
    assert latest_checkpoint(run) == run / "checkpoints" / "step-8"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-8"]
    # weights_only loading of the RNG file works (no pickle of arbitrary objects).
    assert (
        torch.load(run / "checkpoints" / "step-8" / "rng" / "rank-0.pt", weights_only=True)["torch"].dtype
        == torch.uint8
    )


# qwen2-tiny ties its head to the embeddings (as Qwen2.5's small models do): one tensor, which
# freezing its embedding name freezes.
FROZEN_IN_STAGE_2 = ["model.embed_tokens.*", "model.layers.0.mlp.*"]


def _two_stages(model_dir, out, dist, **training):
    """Stage 1 trains every weight for 2 steps; stage 2 freezes the tied embeddings-and-head and
    layer 0's MLP for 2."""
    cfg = make_config(model_dir, out, distributed=dist, training={"max_steps": 2, "save_every": 3, **training})
    cfg["stages"] = [
        {"name": "all"},
        {"name": "frozen-ends-and-mlp", "frozen": FROZEN_IN_STAGE_2, "training": {"max_steps": 2}},
    ]
    return cfg


def test_tied_weights_an_earlier_stage_trained_survive_a_zero3_reshard(tmp_path):
    """A full fine-tune's stage 2 re-targets ZeRO-3 to freeze what stage 1 trained: the tied
    embeddings-and-head (named by its embedding; the head's name kept it training before) and layer
    0's MLP. The two-rank run equals the single-process run step by
    step (its first stage-2 step used to crash: the new engine's backward reported to the old one's
    parameter coordinator). Resumed on one rank from a checkpoint inside stage 2 (written by two),
    the frozen weights stay what stage 1 made them, bit for bit (DeepSpeed's universal load used to
    return them to the loaded model's values), and the resumed steps follow the uninterrupted run.
    The LoRA form of both, under every engine and at world sizes 2 and 3, is the stage-boundary
    matrix of tests/distributed/test_edge_matrix.py."""
    from safetensors.torch import load_file

    from scaletune.models import init_model

    tied = init_model("qwen2-tiny", tmp_path / "qwen2-tiny", seed=0, tokenizer_file=SMALL_TOKENIZER)
    train(_two_stages(tied, tmp_path / "single", SINGLE), tmp_path, name="single.yaml")
    train(_two_stages(tied, tmp_path / "run", STRATEGIES["zero3"]), tmp_path)
    assert_same_steps(tmp_path / "run", tmp_path / "single", 1e-5, "zero3: two stages on 2 ranks", grad_rel=GRAD_REL)
    ckpt = tmp_path / "run" / "checkpoints" / "step-3"
    assert json.loads((ckpt / "progress.json").read_text())["stage_name"] == "frozen-ends-and-mlp"
    one = {**STRATEGIES["zero3"], "num_processes": 1}
    cfg = _two_stages(tied, tmp_path / "resumed", one, resume=str(ckpt))
    proc = train(cfg, tmp_path, name="resumed.yaml")
    assert "resharded step-3: written by 2 rank(s)" in proc.stderr
    start = load_file(str(tied / "model.safetensors"))
    want = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "resumed" / "final" / "model.safetensors"))
    frozen = [k for k in want if k.startswith(("model.layers.0.mlp.", "model.embed_tokens."))]
    assert len(frozen) == 4 and "lm_head.weight" not in want  # tied: stored once
    # Stage 2's step 4 left the tied tensor as step 3 had it (under the head's name it kept training).
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    at = [ckpt.parent / f"step-{step}" / "deepspeed" for step in (3, 4)]
    embed = [
        get_fp32_state_dict_from_zero_checkpoint(str(d), tag="state")["causal_lm.model.embed_tokens.weight"] for d in at
    ]
    assert torch.equal(embed[0], embed[1]), "the frozen tied embeddings trained in stage 2"
    for key in frozen:
        assert not torch.equal(want[key], start[key].to(want[key].dtype)), f"{key} did not train in stage 1"
        assert torch.equal(got[key], want[key]), f"zero3: {key} changed by the reshard"
    assert_same_steps(
        tmp_path / "resumed", tmp_path / "run", 1e-4, "zero3: 2 -> 1 in stage 2", first=3, grad_rel=GRAD_REL
    )

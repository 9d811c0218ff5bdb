"""`scaletune train` end to end through the CLI on real data: full fine-tuning (LoRA: test_lora_control.py), the run
directory, the accumulation identity, and every bad input (exit 2, nothing written)."""

from __future__ import annotations

import json
import math
import os
import re
import resource

import torch
import yaml

import scaletune
from tests.helpers import (
    ALPACA_5000,
    assert_close,
    assert_located,
    assert_refused,
    losses,
    make_config,
    metrics,
    modules_after,
    run_cli,
    train,
)

EVAL_DROP = 0.1  # eval loss from step 3 to step 8 (measured: 0.20)
DESIGN_FIELDS = {"step", "stage", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}


def test_full_finetune_run_directory(tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "run", logging={"tensorboard": True})
    cfg["data"]["eval_fraction"] = 0.1
    cfg["training"].update(eval_every=3, resume="auto")
    # On one core of the machine's (`taskset -c`): torch's intra-op pool is sized from the cores this
    # process may use, not the machine's, and the start says so.
    one_core = {min(os.sched_getaffinity(0))}
    proc = train(cfg, tmp_path, cores=one_core)
    assert "[scaletune] CPU threads: 1 per rank (1 cores: affinity 1, " in proc.stderr, proc.stderr[-3000:]
    # resume: auto in a run directory without checkpoints starts fresh, and says so.
    assert "no checkpoint" in proc.stderr and "starting fresh" in proc.stderr
    run = tmp_path / "run"
    # Which scaletune wrote the run, as a comment in its config.yaml (control: the package's version).
    assert (run / "config.yaml").read_text().startswith(f"# written by scaletune {scaletune.__version__}")
    rows = metrics(run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7, 8]
    for r in steps:
        assert DESIGN_FIELDS <= set(r), set(r) ^ DESIGN_FIELDS
        assert r["stage"] == "main" and r["tokens"] > 0 and r["tokens_per_s"] > 0
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [3, 6, 8]
    for step, loss in evals.items():  # the console's eval lines with SFT's headline (control: exp of the file's loss)
        assert f"[scaletune] step {step} eval_loss {loss:.4f} eval_perplexity {math.exp(loss):.2f}\n" in proc.stderr
        # each pass counted on the console, to its last micro-batch (a long eval is not silent)
        assert re.search(rf"\[scaletune\] eval at step {step}: (\d+)/\1 micro-batches, \d+ s\n", proc.stderr), step
    # Training moves the model: the same held-out records score better after more updates (the
    # training loss alone would also move with each step's batch; see test_parity's lr=0 control).
    assert evals[3] > evals[6] > evals[8] and evals[3] - evals[8] > EVAL_DROP, evals
    # warmup 2 then cosine: lr rises, then falls
    lrs = [r["lr"] for r in steps]
    assert lrs[0] < lrs[1] and lrs[2] > lrs[-1]
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["training"]["global_batch_size"] == 8 and resolved["model"]["trust_remote_code"] is False
    assert (run / "loss.png").stat().st_size > 1000
    # The memory plan's prediction and what the rank measured after its first step.
    planned = json.loads((run / "plan.json").read_text())
    measured = json.loads((run / "memory.json").read_text())["ranks"]
    assert planned["name"] == "ddp" and [r["rank"] for r in measured] == [0]
    for key in ("params", "grads", "optimizer"):
        assert abs(measured[0][key] - planned["per_rank_bytes"][key]) <= 0.02 * planned["per_rank_bytes"][key]
    assert measured[0]["peak_device"] is None  # no allocator on the CPU
    assert any((run / "tensorboard").iterdir())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.model_type == "olmo2" and tok.eos_token is not None
    # The exported weights are the trained ones, not the initial ones.
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(model.lm_head.weight, init.lm_head.weight)


def test_accumulation_identity_4x1_equals_1x4(tiny_model_dir, tmp_path):
    """Four micro-batches of one and one micro-batch of four make the same optimizer step."""
    runs = {}
    for micro in (1, 4):
        cfg = make_config(
            tiny_model_dir,
            tmp_path / f"m{micro}",
            training={"global_batch_size": 4, "micro_batch_size": micro, "max_steps": 4},
        )
        train(cfg, tmp_path, name=f"m{micro}.yaml")
        runs[micro] = losses(tmp_path / f"m{micro}")
    assert_close(runs[4], runs[1], 1e-5, "1x4 vs 4x1")


# ---------------------------------------------------------------------------------------------
# Bad input: exit code 2, one message naming every problem, no traceback, nothing written.


def test_every_config_data_and_model_problem_in_one_message(tiny_model_dir, tmp_path):
    """One run, every problem the preflight finds before a rank starts (each rule in-process:
    tests/unit/test_config.py, test_resolve.py, test_data.py): two unknown keys, a global batch
    that 2 ranks of 2 cannot split (checked in the parent before torchrun starts the ranks, so exit
    2, not a crash), a sequence longer than the model's positions, a malformed JSONL file and a
    missing one."""
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n{"instruction": "x"}\n')
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        data={
            "max_seq_length": 100_000,
            "train": {"path": str(bad_jsonl), "format": "alpaca"},
            "eval": {"path": str(tmp_path / "missing.json"), "format": "alpaca"},
        },
        training={"global_batch_size": 6, "micro_batch_size": 2, "learnig_rate": 0.1},
        model={"lora": {"rank": 4}},
        distributed={"strategy": "ddp", "num_processes": 2},
    )
    err = assert_refused(cfg, tmp_path)
    config = tmp_path / "config.yaml"
    assert "cannot start training (7 problems)" in err, err
    assert_located(
        err, config, "  learnig_rate: 0.1", "training.learnig_rate: unknown key (did you mean 'learning_rate'?)"
    )
    assert_located(err, config, "    rank: 4", "model.lora.rank: unknown key; allowed here: r, alpha")
    assert_located(
        err,
        config,
        "  global_batch_size: 6",
        "training.global_batch_size (6) must be a multiple of micro_batch_size x world_size (2 x 2 = 4)",
    )
    assert_located(err, config, "  max_seq_length: 100000", "data.max_seq_length (100000) is larger than the model's")
    assert "max_position_embeddings (2048), the positions" in err
    assert f"{bad_jsonl}:2: not valid JSON" in err  # the malformed line
    assert f"{bad_jsonl}:3: record 3: missing field 'output'" in err  # the record missing its field
    assert f"{tmp_path / 'missing.json'}: data file not found" in err


def test_empty_after_filtering(tiny_model_dir, tmp_path):
    """The data phase (a valid config whose data tokenise to nothing): its own run."""
    cfg = make_config(tiny_model_dir, tmp_path / "run", data={"max_seq_length": 8})
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "max_seq_length" in proc.stderr


def test_finished_run_is_not_overwritten(tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "run", training={"max_steps": 1})
    train(cfg, tmp_path)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2 and "holds a finished run" in proc.stderr and "overwrite: true" in proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    cfg["overwrite"] = True
    train(cfg, tmp_path)
    assert len(losses(tmp_path / "run")) == 1


def test_unknown_preset_and_usage_errors(tmp_path):
    proc = run_cli(["init-model", "no-such-preset", "-o", str(tmp_path / "m")])
    assert proc.returncode == 2 and "olmo2-tiny" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["train"])
    assert proc.returncode == 2


def test_alpaca_full_example_reads_shared_data():
    from scaletune.config import load_config
    from tests.helpers import REPO_ROOT

    cfg = load_config(REPO_ROOT / "examples" / "alpaca-full.yaml")
    assert (REPO_ROOT / cfg.data.train.path).resolve() == ALPACA_5000.resolve()


def test_divergence_stops_without_a_poisoned_checkpoint(tiny_model_dir, tmp_path):
    """An absurd learning rate without clipping drives the loss to inf/NaN: the run stops naming
    the step and the last good checkpoint, and writes no checkpoint of the diverged state."""
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        training={
            "learning_rate": 1.0e30,
            "max_grad_norm": None,
            "warmup_steps": 0,
            "lr_scheduler": "constant",
            "save_every": 1,
            "max_steps": 8,
        },
    )
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 1
    assert "training diverged at step" in proc.stderr, proc.stderr[-3000:]
    step = int(proc.stderr.split("training diverged at step ")[1].split(":")[0])
    good = step - 1
    assert f"Last good checkpoint: {tmp_path / 'run' / 'checkpoints' / f'step-{good}'}" in proc.stderr
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert f"step-{step}" not in names and not any(n.startswith(".tmp") for n in names)
    import math

    logged = {m["step"]: m["loss"] for m in metrics(tmp_path / "run") if "loss" in m}
    assert all(math.isfinite(logged[s]) for s in range(1, step)) and not math.isfinite(logged[step])


def test_train_check_imports_no_deepspeed_and_no_service(tiny_model_dir, tmp_path):
    """`train --check` imports what its checks use (torch, transformers for the model on the meta
    device, datasets to tokenise), not DeepSpeed (its classes join torch's allow-list only in a
    process that trains) nor the job service, nor bitsandbytes for a config that quantizes nothing
    (peft imports it whenever it is installed, and it compiles its CPU ops at import: run/entry.py)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "run")))
    loaded = modules_after(["train", str(path), "--check"])
    assert "transformers" in loaded  # the checks ran
    unwanted = {"deepspeed", "fastapi", "scaletune.serve", "scaletune.strategies.deepspeed", "bitsandbytes"}
    assert not loaded & unwanted, sorted(loaded & unwanted)


def test_a_config_typo_is_answered_before_torch_is_imported(tiny_model_dir, tmp_path):
    """A config that does not validate is answered from the config, the model folder's config.json
    and the data files, before torch and transformers are imported (2.7 and 1.3 s of CPU): in under
    3 s of CPU (0.6 s measured). The problems found that way are all there: the typo, and a sequence
    longer than the model's positions, read from its config.json. Control: the same config without
    the typo (`train --check` above) imports both."""
    path = tmp_path / "config.yaml"
    cfg = make_config(
        tiny_model_dir, tmp_path / "run", training={"learnig_rate": 0.1}, data={"max_seq_length": 100_000}
    )
    path.write_text(yaml.safe_dump(cfg))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run_cli(["train", str(path)], fresh=True)  # a new process: what it costs to start is the question
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "training.learnig_rate: unknown key (did you mean 'learning_rate'?)" in proc.stderr
    assert "max_position_embeddings (2048)" in proc.stderr
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 3.0, f"a typo took {cpu:.1f} s of CPU to answer"
    loaded = modules_after(["train", str(path)], returncode=2)
    assert not loaded & {"torch", "transformers", "datasets"}, sorted(loaded & {"torch", "transformers", "datasets"})

"""A LoRA run on the tiny model with the first-hour features, then `chat`, `generate` and `eval`
through the CLI. Controls: the eval verb against the trainer's own eval loss and against the base
model's step-0 loss; generate against the trainer's samples; W&B's offline run file against
metrics.jsonl; planted secrets against every file the run wrote."""

from __future__ import annotations

import json
import os
import pty
import select
import struct
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ALPACA_5000, REPO_ROOT, make_config, metrics, run_cli, train

PROMPTS = ["Name a colour.", "What is two plus two?"]
SECRET_ENV = "wandb-key-from-environment-3f9c"
SECRET_CFG = "token-in-config-env-8d21"


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, module_tmp_path):
    tmp = module_tmp_path
    records = json.loads(ALPACA_5000.read_text())
    (tmp / "eval.json").write_text(json.dumps(records[100:108]))
    cfg = make_config(
        tiny_model_dir,
        tmp / "run",
        model={"lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "gradient_checkpointing": True},
        data={"eval": {"path": str(tmp / "eval.json")}},
        training={
            "max_steps": 4,
            "save_every": 2,
            "learning_rate": 1e-2,
            "eval_on_start": True,
            "sample_prompts": PROMPTS,
            "sample_max_new_tokens": 6,
        },
        logging={"tensorboard": False, "wandb": {"project": "scaletune-tests", "name": "lora", "mode": "offline"}},
        distributed={"env": {"HF_TOKEN": SECRET_CFG}},
    )
    proc = train(cfg, tmp, env={"WANDB_API_KEY": SECRET_ENV, "WANDB_SILENT": "true"})
    return tmp / "run", tmp / "eval.json", proc


def _eval(target, data, *extra) -> float:
    proc = run_cli(["eval", str(target), "--data", str(data), "--json", *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["loss"]


def test_metrics_open_with_the_step0_eval_and_the_eval_verb_reproduces_both_ends(lora_run, tiny_model_dir):
    run, eval_file, _ = lora_run
    rows = metrics(run)
    assert rows[0]["step"] == 0 and "eval_loss" in rows[0] and "loss" not in rows[0]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 4]
    start, end = evals[0][1], evals[-1][1]
    assert end < start - 1e-3, evals  # lr 1e-2 on LoRA moves the loss
    # The eval verb masks as training does: on the run (adapter on its base) it gives the final eval
    # loss, on the base folder the step-0 one. Loaded without its adapter, the run would give `start`.
    assert _eval(run, eval_file) == pytest.approx(end, rel=1e-4)
    assert _eval(tiny_model_dir, eval_file, "--max-seq-length", "64") == pytest.approx(start, rel=1e-4)


def test_samples_before_and_after_are_written_and_generate_reproduces_them(lora_run, tiny_model_dir, tmp_path):
    run, _, proc = lora_run
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS and all("base" in r and "trained" in r for r in rows)
    md = (run / "samples.md").read_text()
    assert all(f"## {p}" in md for p in PROMPTS) and "**trained**" in md
    assert "sample answers before and after training" in proc.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out.jsonl"
    gen = run_cli(["generate", str(run), "--prompts", str(prompts), "--max-new-tokens", "6", "-o", str(out)])
    assert gen.returncode == 0, gen.stderr[-3000:]
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["prompt"] for a in answers] == PROMPTS
    assert [a["response"] for a in answers] == [r["trained"] for r in rows]
    # The base model prompted the same way (the run trained on Alpaca prompts) gives the base answers.
    alpaca = run_cli(
        ["generate", str(tiny_model_dir), "--prompts", str(prompts), "--max-new-tokens", "6", "--template", "alpaca"]
    )
    assert [json.loads(x)["response"] for x in alpaca.stdout.splitlines()] == [r["base"] for r in rows]


def test_chat_reads_standard_input(lora_run):
    run, _, _ = lora_run
    script = f"{PROMPTS[0]}\n/reset\n{PROMPTS[1]}\n"
    proc = run_cli(["chat", str(run), "--temperature", "0", "--max-new-tokens", "6"], input=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    answers = [line.removeprefix("model> ") for line in proc.stdout.splitlines() if line.startswith("model> ")]
    # samples.jsonl keeps the answer stripped; chat prints the decoded text as is (a leading space
    # when the first token starts with one, as the tests' tiny model's does).
    assert [a.strip() for a in answers] == [r["trained"] for r in rows]
    assert "(conversation forgotten)" in proc.stdout


def test_chat_in_a_terminal_prompts_and_streams(lora_run):
    """Through a pseudo-terminal: the interactive prompt appears, the answer streams, /exit ends."""
    run, _, _ = lora_run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI with the terminal as stdin/stdout
        os.execve(
            sys.executable,
            [sys.executable, "-m", "scaletune", "chat", str(run), "--temperature", "0", "--max-new-tokens", "6"],
            env,
        )
    seen = b""

    def read_until(marker: bytes, timeout: float = 300) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < end:
            if select.select([fd], [], [], 1)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:
                    break
        assert marker in seen, seen[-2000:]

    try:
        read_until(b"you> ")
        assert b"/reset forgets" in seen  # the help line shown to a terminal
        os.write(fd, PROMPTS[0].encode() + b"\n")
        read_until(b"model> ")
        read_until(b"you> ", timeout=120)
        os.write(fd, b"/exit\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (LevelDB log framing: 32 KiB blocks, 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, out, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def test_wandb_offline_run_holds_the_metrics_and_no_secret(lora_run):
    run, _, _ = lora_run
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((run / "wandb").rglob("*"))
    history = {}
    config = None
    for rec in _wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
    train_rows = [r for r in metrics(run) if "loss" in r]
    assert [history[r["step"]]["train/loss"] for r in train_rows] == pytest.approx([r["loss"] for r in train_rows])
    assert history[4]["eval/loss"] == pytest.approx(metrics(run)[-1]["eval_loss"])
    assert config is not None
    section = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    assert section["training"]["learning_rate"] == 1e-2
    assert section["distributed"]["env"]["HF_TOKEN"] == "<redacted>"
    leaked = [
        p
        for p in run.rglob("*")
        if p.is_file() and (SECRET_ENV.encode() in p.read_bytes() or SECRET_CFG.encode() in p.read_bytes())
    ]
    assert not leaked


def test_output_is_quiet_and_line_based_without_a_terminal(lora_run):
    _, _, proc = lora_run
    # A LoRA run that saves DCP checkpoints in one process: both warnings used to print here.
    assert "torch.distributed is disabled" not in proc.stderr
    assert "is_gradient_checkpointing" not in proc.stderr
    assert "[scaletune] main 1/4 loss" in proc.stderr and "[scaletune] main 4/4 loss" in proc.stderr


def test_bad_targets_exit_2_without_traceback(lora_run, tmp_path):
    run, eval_file, _ = lora_run
    for args, message in [
        (["chat", str(tmp_path / "missing")], "no such run directory"),
        # A checkpoint is a target (exported when loaded); the folder of checkpoints is not.
        (["eval", str(run / "checkpoints"), "--data", str(eval_file)], "neither a run directory nor"),
        (["eval", str(run), "--data", str(eval_file), "--format", "csv"], "--format csv"),
        (["generate", str(run), "--prompts", str(tmp_path / "none.txt")], "prompts file not found"),
    ]:
        proc = run_cli(args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)

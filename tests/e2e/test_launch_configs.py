"""`scaletune config deepspeed|fsdp` in a subprocess: what the CLI writes is accepted by
DeepSpeed's own config parser and by transformers.TrainingArguments, both run in a child process
(moved from tests/unit/test_launch_configs.py, which starts no process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from scaletune.launch.configs import fsdp_config
from scaletune.strategies.process_group import free_port
from tests.helpers import run_cli, subprocess_env

# DeepSpeed and transformers are imported in one child process: TrainingArguments(deepspeed=...)
# sets up torch.distributed state that must not leak into the rest of the test session.
CHECK = textwrap.dedent(
    """
    import json, sys
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    out_dir, cases = sys.argv[1], json.loads(sys.argv[2])
    for path, precision, concrete in cases:
        args = TrainingArguments(output_dir=out_dir, deepspeed=path, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=4, max_grad_norm=1.0, bf16=precision == "bf16",
                                 use_cpu=True, report_to=[])
        filled = args.hf_deepspeed_config.config
        assert "auto" not in json.dumps(filled), filled
        ds = DeepSpeedConfig(filled)
        out = {"path": path, "stage": ds.zero_optimization_stage, "train_batch_size": ds.train_batch_size,
               "gas": ds.gradient_accumulation_steps}
        if concrete:
            direct = DeepSpeedConfig(path)  # no HF involved: the file as written
            out["direct_train_batch_size"] = direct.train_batch_size
        print("RESULT " + json.dumps(out), flush=True)
    """
)

VARIANTS = [
    ([], "auto", False, 2),
    (["--zero-stage", "1"], "auto", False, 1),
    (["--zero-stage", "3", "--offload-optimizer", "--offload-params", "--bf16"], "bf16", False, 3),
    (
        [
            "--zero-stage",
            "2",
            "--offload-optimizer",
            "--fp32",
            "--micro-batch-size",
            "2",
            "--gradient-accumulation-steps",
            "4",
            "--gradient-clipping",
            "1.0",
        ],
        "fp32",
        True,
        2,
    ),
]


def test_cli_json_accepted_by_deepspeed_and_transformers(tmp_path):
    """Each variant `scaletune config deepspeed` writes is accepted by TrainingArguments(deepspeed=)
    (which fills the `auto` values) and the result by DeepSpeed's own DeepSpeedConfig; a fully
    concrete file is accepted by DeepSpeedConfig as written."""
    pytest.importorskip("deepspeed")
    cases = []
    for i, (cli_args, precision, concrete, _) in enumerate(VARIANTS):
        path = tmp_path / f"ds{i}.json"
        r = run_cli(["config", "deepspeed", *cli_args, "-o", str(path)])
        assert r.returncode == 0, r.stderr
        json.loads(path.read_text())
        cases.append([str(path), precision, concrete])
    env = subprocess_env(
        DS_ACCELERATOR="cpu",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    r = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path / "o"), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = [json.loads(l[7:]) for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(results) == len(VARIANTS)
    for res, (_, _, concrete, stage) in zip(results, VARIANTS):
        assert res["stage"] == stage and res["train_batch_size"] == 8 and res["gas"] == 4, res
        if concrete:
            assert res["direct_train_batch_size"] == 8


def test_cli_rejects_two_precisions_with_exit_2():
    r = run_cli(["config", "deepspeed", "--bf16", "--fp16"])
    assert r.returncode == 2 and "at most one of" in r.stderr and "Traceback" not in r.stderr


def test_fsdp_trainer_json_accepted_by_training_arguments(tmp_path):
    text, suffix = fsdp_config(reshard_after_forward=False, cpu_offload=True, state_dict_type="full")
    assert suffix == ".json"
    path = tmp_path / "fsdp.json"
    path.write_text(text)
    code = textwrap.dedent(
        """
        import sys
        from transformers import TrainingArguments
        a = TrainingArguments(output_dir=sys.argv[2], fsdp=True, fsdp_config=sys.argv[1], use_cpu=True, report_to=[])
        p = a.fsdp_plugin_args
        assert p["fsdp_version"] == 2 and p["reshard_after_forward"] is False and p["cpu_offload"] is True, p
        assert p["state_dict_type"] == "FULL_STATE_DICT", p
        print("OK")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path / "o")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]

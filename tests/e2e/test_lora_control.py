"""LoRA trains only its adapters and saves only them, checked weight by weight against the run's own initial weights,
with a learning-rate-0 run as the control: at lr=0 nothing moves (adapters and held-out loss stay
bitwise at their initial values), at lr > 0 every adapter's lora_B moves and no base weight does.

The Trainer runs in this process (single strategy, gloo-free) so the weights it trained can be
read where they live; the initial weights are taken when the trainer hands the freshly built
model to the engine, after seeding and loading and before the first step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import make_config, metrics

LORA = {"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "auto"}, "gradient_checkpointing": True}


def train_in_process(model_dir: Path, out: Path, learning_rate: float) -> tuple[dict, dict, list[float], Path]:
    """(initial weights, trained weights, eval losses, run directory) of a 4-step LoRA run, weights
    keyed by name."""
    from scaletune.config import read_config
    from scaletune.env import DistributedEnv
    from scaletune.run import prepare
    from scaletune.run.rundir import opened
    from scaletune.trainer import Trainer

    class Observed(Trainer):
        def wrap(self, model, progress):
            self.initial = {k: v.detach().clone() for k, v in model.named_parameters()}
            super().wrap(model, progress)

    cfg = make_config(
        model_dir,
        out,
        model=LORA,
        training={"learning_rate": learning_rate, "max_steps": 4, "warmup_steps": 0, "save_every": 0, "eval_every": 2},
    )
    cfg["data"]["eval_fraction"] = 0.125  # 8 held-out records, the same in both runs (seeded split)
    env = DistributedEnv.from_environ({})
    spec = prepare(read_config(None, data=cfg), env, environ={})
    trainer = Observed(spec, predicted_memory=None, open_run_dir=opened)
    trainer.fit()
    trained = {k: v.detach().clone() for k, v in trainer.strategy.unwrapped.named_parameters()}
    evals = [m["eval_loss"] for m in metrics(out) if "eval_loss" in m]
    return trainer.initial, trained, evals, out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, module_tmp_path):
    tmp = module_tmp_path
    return {lr: train_in_process(tiny_model_dir, tmp / f"lr{lr}", lr) for lr in (0.0, 2e-3)}


def test_lora_at_lr0_changes_nothing(runs):
    """The control: lr=0 (AdamW's weight decay is scaled by lr too) leaves every weight, adapter
    or base, bitwise as built, so the held-out loss after 2 and after 4 steps is the same number."""
    initial, trained, evals, _ = runs[0.0]
    assert initial.keys() == trained.keys()
    changed = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert changed == [], f"lr=0 changed {changed[:5]}"
    assert len(evals) == 2 and evals[0] == evals[1], evals


def test_lora_trains_only_the_adapters(runs, tiny_model_dir):
    """At lr > 0: every lora_B (built as zeros) is no longer zero, the held-out loss moves below
    the lr=0 control's, and every base weight is bitwise the checkpoint's on disk."""
    from transformers import AutoModelForCausalLM

    initial, trained, evals, _ = runs[2e-3]
    adapters = [k for k in trained if "lora_" in k]
    base = [k for k in trained if "lora_" not in k]
    assert adapters and base
    lora_b = [k for k in adapters if "lora_B" in k]
    assert all(torch.count_nonzero(initial[k]) == 0 for k in lora_b)  # peft's initialisation
    assert [k for k in lora_b if torch.count_nonzero(trained[k]) == 0] == [], "an adapter did not train"
    on_disk = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    # peft names a wrapped Linear's weight base_model.model.<path>.base_layer.weight.
    names = {k: k.removeprefix("base_model.model.").replace(".base_layer.", ".") for k in base}
    assert [n for k, n in names.items() if not torch.equal(trained[k], on_disk[n])] == [], "base weights changed"
    # Every weight on disk was compared (a tied head is one parameter under two names).
    assert set(on_disk) - set(names.values()) <= {"lm_head.weight"}
    control = runs[0.0][2]
    assert evals[0] < control[0] and evals[1] < evals[0], (evals, control)


def test_final_holds_the_trained_adapter_only(runs):
    """final/ is a peft folder (adapter and its config, no full model) that loads back over the
    base model with exactly the adapter weights trained."""
    import json

    from peft import AutoPeftModelForCausalLM

    final = runs[2e-3][3] / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    loaded = dict(AutoPeftModelForCausalLM.from_pretrained(final, dtype=torch.float32).named_parameters())
    trained = runs[2e-3][1]
    adapters = [k for k in trained if "lora_" in k]
    assert [k for k in adapters if not torch.equal(loaded[k], trained[k])] == []

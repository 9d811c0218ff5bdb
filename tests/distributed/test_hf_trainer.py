"""A user's own HF Trainer script under torchrun (2 CPU ranks, gloo): the failure it used to hit,
and the same script fixed by scaletune.hf.

The "seed" script does what many LoRA tutorials do: `from_pretrained(device_map="auto")`,
`get_peft_model`, and `TrainingArguments(gradient_checkpointing=True,
gradient_checkpointing_kwargs={"use_reentrant": True})`. Under torchrun the Trainer wraps the
PeftModel in DDP with `find_unused_parameters=True` (it does so for any model that is not a
`PreTrainedModel`), and reentrant checkpointing then fails in the first backward with "Expected
to mark a variable ready only once". (On GPUs, device_map="auto" additionally spreads each
rank's copy over every GPU; on this CPU machine it is a no-op, so only the checkpointing half of
the failure shows here; the set-aside message is asserted instead.)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = r"""
import json, os, sys
import torch
from transformers import DataCollatorForLanguageModeling, Trainer

mode, model_dir, data_path, out_dir = sys.argv[1:5]
torch.manual_seed(0)

if mode == "seed":
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, device_map="auto")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    args = TrainingArguments(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2, gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": True}, use_cpu=True, logging_steps=1,
                             save_strategy="no", report_to="none", learning_rate=1e-3)
else:
    from scaletune.hf import load_model_for_training, training_arguments

    model, tokenizer = load_model_for_training(
        model_dir, device_map="auto", lora={"r": 8, "alpha": 16, "dropout": 0.0}, gradient_checkpointing=True
    )
    args = training_arguments(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2, gradient_checkpointing=True,
                              logging_steps=1, save_strategy="no", learning_rate=1e-3)

records = json.load(open(data_path))[:64]
texts = [
    f"### Instruction:\n{r['instruction']}\n" + (f"### Input:\n{r['input']}\n" if r["input"] else "")
    + f"### Response:\n{r['output']}{tokenizer.eos_token}"
    for r in records
]
dataset = [tokenizer(t, truncation=True, max_length=96) for t in texts]
trainer = Trainer(model=model, args=args, train_dataset=dataset,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
result = trainer.train()
if int(os.environ["RANK"]) == 0:
    wrapped = trainer.model_wrapped
    print("RESULT " + json.dumps({
        "train_loss": result.training_loss,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "world_size": int(os.environ["WORLD_SIZE"]),
        "wrapper": type(wrapped).__name__,
        "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
    }), flush=True)
"""


def _torchrun(script: Path, mode: str, model_dir: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    from tests.helpers import run_torchrun

    return run_torchrun(
        script, mode, model_dir, data, out, env={"PYTHONWARNINGS": "ignore::FutureWarning"}, timeout=240
    )


def test_user_trainer_script_under_torchrun(tmp_path, tiny_model_dir, shared_data):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    data = shared_data / "alpaca_5000.json"

    seed = _torchrun(script, "seed", tiny_model_dir, data, tmp_path / "seed")
    seed_log = seed.stdout + seed.stderr
    assert seed.returncode != 0, seed_log[-3000:]
    assert "Expected to mark a variable ready only once" in seed_log

    fixed = _torchrun(script, "scaletune", tiny_model_dir, data, tmp_path / "fixed")
    log = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0, log[-5000:]
    assert "model.device_map=auto set aside" in log and "each rank holds its own replica or shard" in log
    # Rank 0 logs it; the other rank stays quiet at INFO.
    assert log.count("model.device_map=auto set aside") == 1
    line = next(l for l in log.splitlines() if l.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["world_size"] == 2
    assert result["wrapper"] == "DistributedDataParallel" and result["find_unused_parameters"] is False
    assert len(result["losses"]) == 3
    assert all(math.isfinite(x) for x in result["losses"]) and math.isfinite(result["train_loss"])
    # A random model of the tests' 27,136-row vocabulary starts near ln(27136) = 10.2 nats per token.
    assert 8.5 < result["losses"][0] < 12.0


EXIT_SCRIPT = r"""
import atexit, sys
import torch, torch.distributed as dist

# Registered first, so it runs last: what the interpreter's finalization will find.
atexit.register(lambda: print("AT EXIT initialized:", dist.is_initialized(), flush=True))
from scaletune.hf import training_arguments

args = training_arguments(output_dir=sys.argv[1])
# What accelerate does for the Trainer under a launcher: a gloo group the script never destroys.
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
t = torch.ones(4)
dist.all_reduce(t)
dist.barrier()
print("trained", flush=True)
"""


def test_helpers_destroy_the_process_group_before_the_interpreter_finalizes(tmp_path):
    """The abort above ("terminate called without an active exception" after training) comes from
    gloo's worker threads outliving Python: the group must be gone before finalization starts."""
    from scaletune.strategies.process_group import free_port
    from tests.helpers import subprocess_env

    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), str(free_port())],
        env=subprocess_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "trained" in run.stdout
    assert "AT EXIT initialized: False" in run.stdout, run.stdout

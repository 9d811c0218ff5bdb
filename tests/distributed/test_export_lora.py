"""LoRA out of every engine, checked by content (the failures users meet: empty or shard-sized
adapters after ZeRO-3, merges that fail after FSDP): for single, ddp, fsdp and ZeRO-1/2/3 at world
size 2, the adapter `final/` holds is

* whole and trained: every LoRA tensor has the shape peft gives the base model, and `lora_B` (zero
  at initialisation) is no longer zero;
* the gathered trained adapter: bit for bit what `scaletune export` consolidates, in another
  process, from the run's last sharded checkpoint;
* the same function as the single-process run's adapter (the control, same global batch), within
  the parity bound on logits;

and the merged export (`scaletune export RUN --merge-lora`) computes base + adapter within 1e-5
(fp32)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.parity_cases import SINGLE, STRATEGIES
from tests.helpers import LORA, assert_same_logits, logits, run_cli

pytestmark = pytest.mark.distributed

ENGINES = {**STRATEGIES, "zero1": {"strategy": "deepspeed", "zero_stage": 1, "num_processes": 2}}
# The run_once names of the LoRA runs test_parity.py and test_resume.py train too (one run each).
SHARED = {"single": "single-lora", "ddp": "ddp-lora-gc", "fsdp": "fsdp-lora-gc"}


def adapter(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


# Every engine: DDP and ZeRO-1/-2 keep every parameter whole on each rank, ZeRO-3 and FSDP gather
# their shards for final/.
@pytest.mark.parametrize("engine", ENGINES)
def test_adapter_and_merge_from_every_engine(engine, run_once, tmp_path):
    run, proc = run_once(SHARED.get(engine, f"{engine}-lora"), model=LORA, distributed=ENGINES[engine])
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = adapter(run / "final")
    ref_run, _ = run_once("single-lora", model=LORA, distributed=SINGLE)
    control = adapter(ref_run / "final")

    # Whole and trained: the single process's tensor names and shapes (peft's, from the base model).
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in control.items()}
    assert all(v.numel() > 0 for v in written.values())
    lora_b = [v for k, v in written.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b), "lora_B still zero: the adapter was not trained"

    # The gathered adapter: the same tensors exported from the last checkpoint by another process.
    exported = tmp_path / "from-checkpoint"
    proc = run_cli(["export", str(run / "checkpoints" / "step-8"), "-o", str(exported)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = adapter(exported)
    assert again.keys() == written.keys()
    for k in written:
        assert torch.equal(again[k], written[k]), f"{engine}: {k} differs between final/ and the checkpoint's export"

    # The same function as the single-process run (parity bound, as test_parity's adapter check).
    if engine != "single":
        assert_same_logits(
            logits(run / "final", adapter=True), logits(ref_run / "final", adapter=True), f"{engine} adapter"
        )

    # Merged: base + adapter, folded in.
    merged = tmp_path / "merged"
    proc = run_cli(["export", str(run), "-o", str(merged), "--merge-lora"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (merged / "adapter_config.json").exists()
    got, want = logits(merged), logits(run / "final", adapter=True)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"{engine} merged: max {(got - want).abs().max():.2e}"

"""torch.compile on the CPU (inductor, a C++ compiler): the compiled paths give the eager ones'
numbers. Compiling takes tens of seconds on two cores, so these are here rather than in tests/unit
(moved from tests/unit/test_attention.py and tests/unit/test_models.py, assertions unchanged):

* scaletune.models.attention: transformers' compiled flex_attention with scaletune's block mask,
  forward, against the dense SDPA control (the eager reference's gradients stay in the unit test).
* scaletune.models.adapters: `model.compile` (`compile_decoder_layers`), loss and every gradient
  against the eager model.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from scaletune import models
from scaletune.config import ModelConfig
from scaletune.models import DevicePlacement
from scaletune.models.attention import packed_mask
from tests.attention_cases import TOL, packed_batch, scaletune_mean_loss, tiny, transformers_mean_loss

CPU = DevicePlacement(None, "cpu")

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("cc") is None, reason="inductor needs a C++ compiler"
)


def test_compiled_flex_forward_equals_dense_sdpa():
    """transformers' own flex call (torch.compile'd flex_attention, the CPU kernel that skips the
    blocks the BlockMask marks empty and skips mask_mod on full ones), forward only: the loss of
    the SDPA control within 1e-5. Covers the block structure, which the eager reference ignores."""
    batch = packed_batch(512, seed=1)
    control = tiny("llama-tiny", "sdpa")
    flex = tiny("llama-tiny", "flex_attention")
    with torch.no_grad():
        want = transformers_mean_loss(control, batch)
        got = scaletune_mean_loss(flex, batch)
    assert abs(float(got - want)) <= TOL, f"loss {float(got)} vs {float(want)}"
    mask = packed_mask(flex.config, batch["position_ids"])
    assert mask.full_kv_num_blocks is not None and int(mask.full_kv_num_blocks.sum()) > 0, "a full block is tested"


def test_compiled_decoder_layers_give_the_eager_loss_and_gradients(tiny_model_dir):
    """model.compile: every decoder layer runs through torch.compile (inductor on this CPU) and the
    summed token loss and every gradient equal the eager model's within 1e-5 (fp32)."""
    from scaletune.data import Collator
    from scaletune.models.loss import CausalLMLoss, target_index

    cfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32", gradient_checkpointing=False)
    eager = models.prepare_model(cfg, CPU)
    compiled = models.prepare_model(cfg.model_copy(update={"compile": True}), CPU)
    layers = [m for m in compiled.modules() if type(m) in models.decoder_layer_classes(compiled)]
    assert len(layers) == 2 and all(m._compiled_call_impl is not None for m in layers)
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 1000, (n,)).tolist()} for n in (12, 7)]
    batch = Collator(0)([{**r, "labels": [-100] * 3 + r["input_ids"][3:]} for r in rows])
    results = []
    for model in (eager, compiled):
        module = CausalLMLoss(model)
        loss = module(
            batch["input_ids"],
            batch["labels"],
            target_index(batch["labels"]),
            batch["attention_mask"],
            batch["position_ids"],
        )
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.allclose(l1, l0, rtol=1e-5), (l1, l0)
    for name, grad in g0.items():  # relative to the tensor's largest gradient: fused kernels reorder sums
        err = float((g1[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-30))
        assert err <= 1e-5, (name, err)

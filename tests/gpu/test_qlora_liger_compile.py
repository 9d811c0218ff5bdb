"""QLoRA computes its matmuls in bf16 and its loss falls; the chunked loss on CUDA (its fp32
accumulation through cuBLAS) and Liger's fused linear cross-entropy equal an fp32 reference within
bf16's bound; torch.compile equals eager on the GPU."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from scaletune.models.loss import CausalLMLoss, chunked_head_cross_entropy, liger_head_cross_entropy, target_index
from tests.helpers import make_config


def batch(vocab: int, rows: int = 4, length: int = 256, seed: int = 0) -> dict:
    from scaletune.data import Collator

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g).tolist()
    return Collator(0)([{"input_ids": r, "labels": [-100] * 16 + r[16:]} for r in ids])


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_under_zero3_loads_and_trains(tiny_model_dir, tmp_path):
    """Issue 38: QLoRA under DeepSpeed ZeRO-3 (the engine resolve sends FSDP + QLoRA users to) loads
    without a device_map, which transformers refuses while ZeRO-3 is announced, and trains: through
    `scaletune train`, one process."""
    from tests.helpers import metrics, train

    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        model={
            "dtype": "bfloat16",
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
            "quantization": {"bits": 4, "storage_dtype": "bfloat16"},
        },
        training={"max_steps": 4, "save_every": 0, "learning_rate": 2e-3},
        distributed={"strategy": "deepspeed", "zero_stage": 3, "num_processes": 1},
    )
    proc = train(cfg, tmp_path)
    rows = [m for m in metrics(tmp_path / "run") if "loss" in m]
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() for m in rows), (
        proc.stderr[-3000:]
    )
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_matmuls_run_in_bf16_and_its_loss_falls(mid_model_dir, tmp_path):
    from scaletune.config import load_config
    from scaletune.env import DistributedEnv
    from scaletune.models import decoder_layer_classes, prepare_model
    from scaletune.resolve import resolve
    from scaletune.strategies import make_strategy, torn_down
    from scaletune.trainer import seed_everything, train_step

    cfg = make_config(
        mid_model_dir,
        tmp_path / "run",
        model={
            "dtype": "bfloat16",
            "gradient_checkpointing": True,
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
            "quantization": {"bits": 4},
        },
        training={"learning_rate": 2e-3, "max_grad_norm": 1.0},
    )
    spec = resolve(load_config(None, data=cfg), DistributedEnv.from_environ())
    assert spec.precision.autocast and spec.precision.storage == "bfloat16"
    strategy = make_strategy(spec)
    with torn_down(strategy):
        seed_everything(0)
        model = prepare_model(
            spec.config.model.model_copy(update={"dtype": spec.precision.storage}), strategy.placement
        )
        # The premise: k-bit preparation and peft leave float32 parameters (norms, adapters).
        assert any(p.dtype == torch.float32 for p in model.parameters())
        strategy.wrap(CausalLMLoss(model))
        # The matmuls' outputs, not the residual stream: peft's k-bit preparation upcasts the
        # embeddings to fp32, so a layer's input (and, cast back to it, a Linear4bit's output) is
        # fp32 by design. What must be bf16: bitsandbytes' 4-bit matmul (it computes in the compute
        # dtype) and the fp32 LoRA A/B matmuls (under autocast).
        import bitsandbytes

        seen: dict[str, torch.dtype] = {}
        real_matmul_4bit = bitsandbytes.matmul_4bit

        def matmul_4bit(*args, **kwargs):
            out = real_matmul_4bit(*args, **kwargs)
            seen.setdefault("matmul_4bit", out.dtype)
            return out

        layer = next(m for m in model.modules() if type(m) in decoder_layer_classes(model))
        loras = {n: m for n, m in layer.named_modules() if type(m) is torch.nn.Linear and ".lora_" in n}
        assert loras, "no LoRA matmul in the layer"
        for name, module in loras.items():
            # A forward hook that returns a value replaces the module's output: this one returns None.
            module.register_forward_hook(lambda mod, args, out, name=name: seen.setdefault(name, out.dtype) and None)
        mb = batch(100_352)
        bitsandbytes.matmul_4bit = matmul_4bit
        try:
            losses = [float(train_step(strategy, [mb]).loss) for _ in range(8)]
        finally:
            bitsandbytes.matmul_4bit = real_matmul_4bit
    assert seen.keys() == {"matmul_4bit", *loras} and set(seen.values()) == {torch.bfloat16}, seen
    assert losses[-1] < losses[0] - 0.5, losses


def reference_head(hidden, weight, targets):
    h, w = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    loss = F.cross_entropy(h @ w.t(), targets, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["chunked", "liger"])
def test_head_losses_equal_fp32_within_bf16(kind):
    if kind == "liger" and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("needs liger-kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, vocab = 3000, 1024, 100_352
    hidden = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    head = torch.nn.Linear(d, vocab, bias=False, device="cuda")  # fp32 master weight
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    want_loss, want_h, want_w = reference_head(hidden, head.weight, targets)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fn = chunked_head_cross_entropy if kind == "chunked" else liger_head_cross_entropy
        loss = fn(hidden, head, targets)
    loss.backward()
    assert rel(loss, want_loss) <= 2e-3, (float(loss), float(want_loss))
    assert rel(hidden.grad, want_h) <= 2e-2
    assert head.weight.grad.dtype == torch.float32 and rel(head.weight.grad, want_w) <= 2e-2


def test_compile_equals_eager_on_the_gpu(tiny_model_dir):
    from scaletune.config import ModelConfig
    from scaletune.models import DevicePlacement, prepare_model

    cfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32", gradient_checkpointing=False)
    gpu = DevicePlacement(None, "cuda:0")
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]  # the tests' cut tokenizer's
    mb = {k: v.cuda() for k, v in batch(vocab, rows=2, length=128).items()}
    results = []
    for compile_ in (False, True):
        model = prepare_model(cfg.model_copy(update={"compile": compile_}), gpu)
        loss = CausalLMLoss(model)(
            mb["input_ids"], mb["labels"], target_index(mb["labels"]).cuda(), None, mb["position_ids"]
        )
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.allclose(l1, l0, rtol=1e-4), (l1, l0)
    for name, grad in g0.items():
        assert rel(g1[name], grad) <= 1e-3, name

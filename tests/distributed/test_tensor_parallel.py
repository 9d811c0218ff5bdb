"""Tensor parallelism (`strategies/parallel/tensor.py`) against the same model on one process.

A tiny Llama (untied and tied head) and a tiny OLMo-2 (its colwise_gather_output / rowwise_split_input
attention), full fine-tuning and LoRA (peft, dropout 0, every projection), trained 3 AdamW steps
with gradient clipping on the same batches: once sharded over 2 ranks (gloo, CPU; built as
`parallel.parallelize` does it: the model on the meta device, `apply_tensor_parallel`, `to_empty`, rank 0's
weights broadcast by `set_model_state_dict`), once whole on rank 0 alone (the control: no
collective, torch's `clip_grad_norm_`). The loss goes through scaletune's `CausalLMLoss` with a small
chunk, so the vocab-parallel cross-entropy runs in several checkpointed chunks. Losses, gradient
norms and the final weights must agree within 1e-4 relative.

Run directly by the test under torchrun (2 ranks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve()
CASES = ["llama", "llama-lora", "llama-tied", "olmo2", "olmo2-lora"]
STEPS, BATCH, SEQ, CHUNK, MAX_NORM, LR = 3, 2, 24, 8, 0.5, 1e-2
RTOL = 1e-4


def build(case: str):
    """The case's model, fp32, the same weights on every call (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Olmo2Config

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    sizes.update(intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    if case.startswith("olmo2"):
        config = Olmo2Config(**sizes)
    else:
        config = LlamaConfig(**sizes, tie_word_embeddings=case == "llama-tied")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if case.endswith("lora"):
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
        with torch.no_grad():  # B != 0 from the start, so every LoRA gradient is non-zero at step 1
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
    return model


def batches():
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :5] = -100  # a prompt that is not trained on
        out.append((ids, labels))
    return out


def train(model, tensor_parallel: bool) -> dict:
    """STEPS optimizer steps; the per-step mean loss and pre-clip gradient norm, and the final weights."""
    import torch

    from scaletune.models.loss import CausalLMLoss, target_index
    from scaletune.strategies.parallel.tensor import grad_norm_and_clip

    loss_module = CausalLMLoss(model, chunk=CHUNK)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses, norms, grads = [], [], {}
    for ids, labels in batches():
        index = target_index(labels)
        loss = loss_module(ids, labels, index) / index.numel()
        loss.backward()
        if not grads:  # step 1's gradients, before any weight has moved
            grads = whole(model, lambda p: p.grad)
        if tensor_parallel:
            norm = grad_norm_and_clip(params, MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(norm.item())
    return {"loss": losses, "norm": norms, "grads": grads, "weights": whole(model, lambda p: p)}


def whole(model, get) -> dict:
    """{name: the whole tensor get(parameter)} of the trainable parameters (DTensors gathered)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = get(p).detach().clone()  # not the live gradient, which clipping scales in place
            out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def sharded(case: str, mesh):
    """The model built as `parallelize` builds it under tensor parallelism (without FSDP)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from scaletune.strategies.parallel.tensor import apply_tensor_parallel

    model = build(case)
    rank0 = torch.distributed.get_rank() == 0
    full = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank0 else {}
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # rotary inv_freq: not in the state dict
    model.to("meta")
    apply_tensor_parallel(model, mesh)
    model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, full, options=options)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    return model


def driver(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import finish_driver

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tensor",))
    results = {}
    for case in CASES:
        model = sharded(case, mesh)
        assert any(hasattr(p, "device_mesh") for p in model.parameters())  # really sharded
        got = train(model, tensor_parallel=True)
        if dist.get_rank() == 0:
            want = train(build(case), tensor_parallel=False)
            assert got["weights"].keys() == want["weights"].keys() == got["grads"].keys()
            gaps = {
                "loss": max(abs(a - b) / abs(b) for a, b in zip(got["loss"], want["loss"], strict=True)),
                "norm": max(abs(a - b) / abs(b) for a, b in zip(got["norm"], want["norm"], strict=True)),
                # per parameter: the largest difference relative to the largest gradient entry
                "grad": max(float((got["grads"][n] - g).abs().max() / g.abs().max()) for n, g in want["grads"].items()),
                # absolute, in units of the learning rate (AdamW's step is about LR per entry whatever
                # the gradient, so entries with a gradient near eps=1e-8 amplify rounding differences)
                "weights": max(float((got["weights"][n] - w).abs().max()) / LR for n, w in want["weights"].items()),
            }
            results[case] = {"gaps": gaps, "loss": want["loss"], "norm": want["norm"], "tp_norm": got["norm"]}
        dist.barrier()
    finish_driver(out, results)
    del torch


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from tests.helpers import run_torchrun

    out = tmp_path_factory.mktemp("tp") / "results.json"
    proc = run_torchrun(HERE, out, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_matches_one_process(results, case):
    res = results[case]
    assert max(res["norm"]) > MAX_NORM  # the clipping really scaled the gradients
    gaps = res["gaps"]
    for what in ("loss", "norm", "grad"):
        assert gaps[what] <= RTOL, f"{case}: {what} differs by {gaps[what]:.2e} relative ({res})"
    assert gaps["weights"] <= 0.1, f"{case}: weights after {STEPS} steps differ by {gaps['weights']:.2e} x LR ({res})"


if __name__ == "__main__":
    driver(Path(sys.argv[1]))

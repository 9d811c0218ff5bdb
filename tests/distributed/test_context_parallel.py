"""Context parallelism (Ulysses, strategies.parallel.context) over 2 ranks against one process.

A tiny Llama (4 heads, 2 KV heads: one KV head a rank after the all-to-all) wrapped in
`CausalLMLoss` computes one collated micro-batch two ways: whole, on one process (the control),
and split by `split_batch` over a 2-rank gloo context group, each rank its slice. The sum of the
two ranks' losses, their parameter gradients summed (what FSDP's reduction over the context ranks
does) and the gradient at the embeddings' output put back together must equal the control's in
fp32, for unpacked rows with padding and for packed rows (position_ids restarting), with and
without gradient checkpointing. The micro-batch's length is not a multiple of 2, so
`split_batch` pads it.

Run directly by the test under torchrun (2 ranks, gloo, CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve()
REL = 1e-4


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).train()  # train(): checkpointing only recomputes in training


def batches() -> dict:
    from scaletune.data.batching import Collator

    def row(n, prompt, seed, positions=None):
        ids = [(seed + 37 * i) % 251 + 2 for i in range(n)]
        out = {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}
        return out if positions is None else {**out, "position_ids": positions}

    collate = Collator(pad_token_id=0)
    first = list(range(7)) + list(range(5)) + list(range(9))  # 21 tokens: examples of 7, 5, 9
    second = list(range(12)) + list(range(6))
    return {
        "unpacked": collate([row(23, 5, 1), row(14, 3, 2), row(6, 0, 3)]),
        "packed": collate([row(21, 0, 4, first), row(18, 0, 5, second)]),
    }


def run(mb: dict, *, checkpointing: bool, group=None) -> tuple[float, dict, object]:
    """(loss, parameter gradients, gradient at the embeddings' output) of one CausalLMLoss pass:
    the whole `mb` when `group` is None, else this rank's slice, summed over the group."""
    import torch
    import torch.distributed as dist

    from scaletune.models.adapters import enable_gradient_checkpointing
    from scaletune.models.loss import CausalLMLoss
    from scaletune.strategies.parallel.context import install, split_batch
    from scaletune.trainer.batches import model_inputs

    model = tiny_llama()
    if checkpointing:
        enable_gradient_checkpointing(model)
    if group is not None:
        install(model, group)
        mb = split_batch(mb, dist.get_rank(group), dist.get_world_size(group))
    inputs = model_inputs(mb)
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: embedded.append(out) or out.retain_grad())
    loss = CausalLMLoss(model)(**inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    embed_grad = embedded[0].grad
    loss = loss.detach()
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
        parts = [torch.empty_like(embed_grad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, embed_grad.contiguous(), group=group)
        embed_grad = torch.cat(parts, dim=1)
    return float(loss), grads, embed_grad


def rel(a, b) -> float:
    import torch

    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp(min=1e-30))


def driver(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from tests.helpers import finish_driver

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for name, mb in batches().items():
        for checkpointing in (False, True):
            loss, grads, embed = run(mb, checkpointing=checkpointing)
            cp_loss, cp_grads, cp_embed = run(mb, checkpointing=checkpointing, group=dist.group.WORLD)
            length = embed.size(1)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
            cp_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in cp_grads.values()]))
            results[f"{name}{'+checkpointing' if checkpointing else ''}"] = {
                "loss": loss,
                "cp_loss": cp_loss,
                "loss_rel": abs(cp_loss - loss) / abs(loss),
                "grad_norm": float(norm),
                "cp_grad_norm": float(cp_norm),
                "grad_rel_worst": max(rel(cp_grads[n], g) for n, g in grads.items()),
                "input_grad_rel": rel(cp_embed[:, :length], embed),
                "input_grad_past_end": float(cp_embed[:, length:].abs().max()) if cp_embed.size(1) > length else 0.0,
            }
    finish_driver(out, results)


def test_two_context_ranks_equal_one_process(tmp_path):
    from tests.helpers import run_torchrun

    out = tmp_path / "results.json"
    proc = run_torchrun(HERE, out, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    assert sorted(results) == ["packed", "packed+checkpointing", "unpacked", "unpacked+checkpointing"]
    for case, r in results.items():
        assert r["loss_rel"] <= REL, (case, r)
        assert r["grad_rel_worst"] <= REL, (case, r)
        assert r["input_grad_rel"] <= REL, (case, r)
        assert r["input_grad_past_end"] == 0.0, (case, r)  # padding added by split_batch is never attended to
        assert abs(r["cp_grad_norm"] - r["grad_norm"]) <= REL * r["grad_norm"], (case, r)


if __name__ == "__main__":
    driver(Path(sys.argv[1]))

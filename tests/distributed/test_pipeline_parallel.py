"""Pipeline parallelism (`strategies/parallel/pipeline.py`) against the same model on one process.

A tiny Llama (4 layers, untied head, fp32, seeded), split into 2 pipeline stages (gloo, CPU, the
1F1B schedule), trained 3 AdamW steps with gradient clipping, each step 4 micro-batches of 2 rows
per data rank: right-padded unpacked rows of varying length (the runner pads each step to one
bucketed shape that only grows, rebuilding its stage only when a step does not fit it) and packed rows (position_ids restarting per
example); full fine-tuning and LoRA (peft); on 2 ranks (pipeline 2) and on 4 (pipeline 2 x data 2,
each stage FSDP2-sharded over its data ranks as `strategies/parallel/parallelize.shard_model` shards). The control
is scaletune's `CausalLMLoss` on the whole model and the whole global batch in one process: each
micro-batch's summed token loss divided by the step's target count, backward, torch's
`clip_grad_norm_`. Losses, gradient norms (over both stages), the first step's gradients, the final
weights and a forward-only (eval) loss must agree within 1e-4 relative.

Run directly by the test under torchrun (2 or 4 ranks).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve()
# case -> (ranks, data-parallel degree, rows packed, LoRA)
CASES = {
    "unpacked": (2, 1, False, False),
    "packed": (2, 1, True, False),
    "lora": (2, 1, True, True),
    "fsdp": (4, 2, False, False),
    "fsdp-lora": (4, 2, True, True),
}
STEPS, MICRO, ROWS, CHUNK, MAX_NORM, LR = 3, 4, 2, 8, 0.3, 1e-2
# Torchrun runs: the cases each runs together (one launch per world size: 2 stages, then 2 stages x 2 data ranks).
RUNS = [("unpacked", "packed", "lora"), ("fsdp", "fsdp-lora")]
RTOL = 1e-4
# AdamW's eps well above the gradients' rounding: with the default 1e-8, its first update is about
# lr * g / |g| per element, so an element whose gradient is near 1e-8 moves by up to lr on rounding
# noise alone (seen: 8e-3 relative on the weights while the gradients agreed to 6e-7).
EPS = 1e-3


def build(lora: bool):
    """The tiny Llama (4 layers, untied head, fp32, sdpa), the same weights on every call; with
    `lora` a peft model (r 4, every projection, B drawn non-zero so every LoRA gradient is)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
    return model


def batches(packed: bool, data: int) -> list[list[dict]]:
    """STEPS global batches of data * MICRO micro-batches of ROWS rows (data rank d reads the d-th
    MICRO of them)."""
    import torch

    g = torch.Generator().manual_seed(1)
    steps = []
    for step in range(STEPS):
        mbs = []
        for i in range(data * MICRO):
            length = 12 + 2 * ((step + i) % 3)  # lengths differ within and across steps
            ids = torch.randint(1, 256, (ROWS, length), generator=g)
            labels = ids.clone()
            labels[:, :3] = -100  # a prompt
            mb = {"input_ids": ids, "labels": labels}
            if not packed:  # row 1 right-padded
                mask = torch.ones_like(ids)
                real = length - 1 - i % MICRO
                mask[1, real:], ids[1, real:], labels[1, real:] = 0, 0, -100
                mb["attention_mask"] = mask
            else:  # three examples a row, each position restarting at 0
                cuts = [0, 5, length - 4, length]
                mb["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).repeat(ROWS, 1)
                labels[:, cuts[1]] = -100  # no target across an example boundary
                labels[:, cuts[2]] = -100
            mbs.append(mb)
        steps.append(mbs)
    return steps


def targets(mbs: list[dict]) -> int:
    return sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)


def control(case: str) -> dict:
    """The whole model on the whole global batch in one process: per-step loss, pre-clip norm, the
    first step's gradients, final weights, the eval loss of the last global batch."""
    import torch

    from scaletune.models.loss import CausalLMLoss, target_index

    _, data, packed, lora = CASES[case]
    model = build(lora)
    loss_module = CausalLMLoss(model, chunk=CHUNK)
    params = {"causal_lm." + n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01, eps=EPS)

    def summed(mb):
        index = target_index(mb["labels"])
        return loss_module(mb["input_ids"], mb["labels"], index, mb.get("attention_mask"), mb.get("position_ids"))

    losses, norms, grads = [], [], {}
    for mbs in batches(packed, data):
        denominator = targets(mbs)
        total = 0.0
        for mb in mbs:
            loss = summed(mb) / denominator
            loss.backward()
            total += loss.item()
        if not grads:
            grads = {n: p.grad.clone() for n, p in params.items()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    with torch.no_grad():
        eval_loss = sum(summed(mb).item() for mb in batches(packed, data)[-1])
    weights = {n: p.detach() for n, p in params.items()}
    return {"loss": losses, "norm": norms, "eval": eval_loss, "weights": weights, "grads": grads}


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def pipelined(case: str, mesh) -> dict:
    """The same on the (pipeline, data_shard) mesh: this rank's stage, FSDP2-sharded over
    data_shard where that is > 1 (as `strategies/parallel/parallelize.py` shards), run by PipelineRunner."""
    import torch
    import torch.distributed as dist

    from scaletune.models import decoder_layer_classes
    from scaletune.strategies.parallel.parallelize import shard_model
    from scaletune.strategies.parallel.pipeline import PipelineRunner, pipeline_clip_grad_norm_, split_stage

    _, data, packed, lora = CASES[case]
    pp, dp = mesh["pipeline"], mesh["data_shard"]
    stage_index, num_stages = pp.get_local_rank(), pp.size()
    stage = split_stage(build(lora), stage_index, num_stages, chunk=CHUNK)
    if data > 1:
        shard_model(stage, tuple(decoder_layer_classes(stage.causal_lm)), mesh=dp)
    params = {n: p for n, p in stage.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01, eps=EPS)
    group = pp.get_group()
    runner = PipelineRunner(stage, stage_index, num_stages, group, torch.device("cpu"), MICRO, grad_divisor=data)
    mine = slice(dp.get_local_rank() * MICRO, (dp.get_local_rank() + 1) * MICRO)
    losses, norms, grads = [], [], {}
    for mbs in batches(packed, data):
        denominator = torch.tensor(float(targets(mbs[mine])))
        dist.all_reduce(denominator, group=dp.get_group())  # the global batch's target count
        loss = runner.step(mbs[mine], denominator)
        dist.all_reduce(loss, group=group)  # 0 on all but the last stage: the last stage's loss everywhere
        dist.all_reduce(loss, group=dp.get_group())  # summed over the data ranks' micro-batches
        if not grads:
            grads = {n: whole(p.grad).clone() for n, p in params.items()}
        norms.append(float(pipeline_clip_grad_norm_(params.values(), MAX_NORM, group)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    eval_loss = runner.forward_only(batches(packed, data)[-1][mine])
    dist.all_reduce(eval_loss, group=group)
    dist.all_reduce(eval_loss, group=dp.get_group())
    weights = {n: whole(p).detach() for n, p in params.items()}
    out = {"loss": losses, "norm": norms, "eval": float(eval_loss), "weights": weights, "grads": grads}
    return out | {"stage": stage}


def reshard_gap(stage, want: dict, directory: Path) -> float:
    """Every rank saves its (sharded) stage with DCP; rank 0 alone loads that checkpoint into the
    whole model (pipeline 1, data 1) by the `CausalLMLoss` names: the worst relative gap to the
    control's final weights (0 on the other ranks)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from scaletune.models.loss import CausalLMLoss

    dcp.save(get_model_state_dict(stage), checkpoint_id=directory)
    alone = dist.new_group([0])  # every rank takes part in making it
    worst = 0.0
    if dist.get_rank() == 0:
        whole_model = CausalLMLoss(build(lora=False))
        with torch.no_grad():
            for p in whole_model.parameters():
                p.zero_()
        state = whole_model.state_dict()
        dcp.load(state, checkpoint_id=directory, process_group=alone)
        worst = max(float((state[n] - w).abs().max() / w.abs().max()) for n, w in want["weights"].items())
    dist.barrier()
    return worst


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def tensor_gap(got: dict, want: dict) -> float:
    """max |got - want| / max |want| over this rank's tensors, the worst over all ranks."""
    import torch
    import torch.distributed as dist

    worst = torch.tensor(max(float((t - want[n]).abs().max() / want[n].abs().max()) for n, t in got.items()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def driver(out: Path, cases: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import finish_driver

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pipeline", "data_shard"))
    results = {}
    for case in cases:
        assert CASES[case][0] == world, case
        got, want = pipelined(case, mesh), control(case)
        names = [None] * world
        dist.all_gather_object(names, sorted(got["weights"]))
        union = sorted({n for stage_names in names for n in stage_names})
        results[case] = {
            "gaps": {
                "loss": gap(got["loss"], want["loss"]),
                "norm": gap(got["norm"], want["norm"]),
                "eval": abs(got["eval"] - want["eval"]) / want["eval"],
                "grads": tensor_gap(got["grads"], want["grads"]),
                "weights": tensor_gap(got["weights"], want["weights"]),
            },
            "loss": want["loss"],
            "norm": want["norm"],
            "names_partition": union == sorted(want["weights"]),
        }
        if not CASES[case][3]:  # full fine-tuning: the checkpoint loads at pipeline 1
            results[case]["gaps"]["resharded"] = reshard_gap(got["stage"], want, out.parent / f"dcp-{case}")
    finish_driver(out, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Callable[[str], dict]:
    """`results(case)`: the case's gaps, from the torchrun of its group in RUNS (run once)."""
    from tests.helpers import run_torchrun

    done: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in done:
            cases = next(run for run in RUNS if case in run)
            out = tmp_path_factory.mktemp("pp") / "results.json"
            proc = run_torchrun(HERE, out, *cases, nproc=CASES[case][0], timeout=240)
            assert proc.returncode == 0, proc.stderr[-6000:]
            done.update(json.loads(out.read_text()))
        return done[case]

    return get


@pytest.mark.parametrize("case", [case for run in RUNS for case in run])
def test_pipeline_matches_one_process(results, case):
    res = results(case)
    assert res["names_partition"]  # the stages' parameters are the model's, each on one stage
    assert max(res["norm"]) > MAX_NORM  # the clipping really scaled the gradients
    for what, value in res["gaps"].items():
        assert value <= RTOL, f"{case}: {what} differs by {value:.2e} relative ({res})"


if __name__ == "__main__":
    driver(Path(sys.argv[1]), sys.argv[2:])

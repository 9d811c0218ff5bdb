"""The memory plan against what real strategies hold: params, grads and optimizer bytes per rank
predicted by scaletune.plan equal what each engine measures of itself (`Strategy.memory_breakdown`)
on real CPU runs within 2%.

One torchrun launch of 2 ranks (gloo) runs every multi-rank case one after the other in one
process group (this file is also the driver: `python tests/distributed/test_memory.py CASES`);
single runs in the test process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]

LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "auto"}
#: case -> (distributed section, lora or None)
CASES = {
    "ddp": ({"strategy": "ddp"}, None),
    "ddp-lora": ({"strategy": "ddp"}, LORA),
    "fsdp": ({"strategy": "fsdp"}, None),
    "fsdp-lora": ({"strategy": "fsdp"}, LORA),
    "zero1": ({"strategy": "deepspeed", "zero_stage": 1}, None),
    "zero2": ({"strategy": "deepspeed", "zero_stage": 2}, None),
    "zero2-lora": ({"strategy": "deepspeed", "zero_stage": 2}, LORA),
    "zero3": ({"strategy": "deepspeed", "zero_stage": 3}, None),
    "zero3-lora": ({"strategy": "deepspeed", "zero_stage": 3}, LORA),
}


def config_dict(model_dir: str, dist: dict, lora: dict | None) -> dict:
    """The tiny run of one case: one step of 4 dummy sequences of 32 tokens in micro batches of 2."""
    from tests.helpers import make_config

    return make_config(
        model_dir,
        "unused",
        model={"gradient_checkpointing": lora is not None, "lora": lora, "attn_implementation": None},
        data={"train": None, "dummy": {"num_samples": 8}, "max_seq_length": 32},
        training={"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 1, "learning_rate": 1e-3},
        distributed={"num_processes": 2, **dist},
    )


def run_case(model_dir: str, dist: dict, lora: dict | None) -> dict:
    """Build the strategy, run one optimizer step on a dummy batch, return its memory breakdown."""
    import torch

    from scaletune.config import load_config
    from scaletune.env import DistributedEnv
    from scaletune.models import prepare_model, resolve_device_map
    from scaletune.models.loss import CausalLMLoss
    from scaletune.resolve import decide
    from scaletune.strategies import make_strategy
    from scaletune.trainer import seed_everything, train_step

    cfg = load_config(None, data=config_dict(model_dir, dist, lora))
    env = DistributedEnv.from_environ()
    spec = decide(cfg, env)
    batch = spec.batch
    strategy = make_strategy(spec)
    strategy.setup()
    try:
        seed_everything(0)
        placement = resolve_device_map(None, env, engine_places_model=strategy.engine_places_model)
        model = prepare_model(
            cfg.model.model_copy(update={"dtype": spec.precision.storage}), placement, meta=strategy.load_meta()
        )
        strategy.wrap(CausalLMLoss(model, partitioned_head=strategy.partitions_head))
        g = torch.Generator().manual_seed(env.rank)
        micro = []
        for _ in range(batch.gradient_accumulation_steps):
            ids = torch.randint(0, 1000, (batch.micro_batch_size, cfg.data.max_seq_length), generator=g)
            micro.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
        strategy.train_mode(True)
        train_step(strategy, micro)
        return strategy.memory_breakdown()
    finally:
        strategy.teardown()


def _driver(model_dir: str, out_dir: str, names: list[str]) -> None:
    """Under torchrun: one process group for every case, one JSON line per case in
    `out_dir/rank<R>.jsonl` (stdout of two ranks interleaves)."""
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    try:
        for name in names:
            dist_cfg, lora = CASES[name]
            m = run_case(model_dir, dist_cfg, lora)
            with open(Path(out_dir) / f"rank{dist.get_rank()}.jsonl", "a") as f:
                f.write(json.dumps({"case": name, **m}) + "\n")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def planned(model_dir: str, dist: dict, lora: dict | None, world_size: int):
    from scaletune.config import load_config
    from scaletune.env import DistributedEnv
    from scaletune.plan import plan
    from scaletune.resolve import decide

    cfg = load_config(None, data=config_dict(model_dir, dist, lora))
    spec = decide(cfg, DistributedEnv("none"), world_size=world_size)
    return plan(spec, gpu_memory_bytes=None).for_run(spec)


def _compare(case: str, measured: dict, entry) -> list[str]:
    bad = []
    for key in ("params", "grads", "optimizer"):
        want, got = getattr(entry, key), measured[key]
        if abs(got - want) > 0.02 * max(want, 1):
            bad.append(
                f"{case} rank {measured['rank']} {key}: planned {want:,} measured {got:,} ({(got - want) / max(want, 1):+.2%})"
            )
    return bad


@pytest.fixture(scope="module")
def world2(tiny_model_dir, module_tmp_path):
    out_dir = module_tmp_path
    from tests.helpers import run_torchrun

    proc = run_torchrun(HERE, tiny_model_dir, out_dir, *CASES, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    out: dict[str, list[dict]] = {}
    for path in sorted(out_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec.pop("case"), []).append(rec)
    return out


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_measured_world2(case, world2, tiny_model_dir):
    dist, lora = CASES[case]
    entry = planned(str(tiny_model_dir), dist, lora, 2)
    ranks = world2[case]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    rank0 = next(r for r in ranks if r["rank"] == 0)
    assert rank0["peak_device"] is None
    assert not _compare(case, rank0, entry)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_plan_matches_measured_single(kind, tiny_model_dir, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    dist = {"strategy": "single", "num_processes": 1}
    lora = LORA if kind == "lora" else None
    measured = run_case(str(tiny_model_dir), dist, lora)
    entry = planned(str(tiny_model_dir), dist, lora, 1)
    assert not _compare(f"single-{kind}", measured, entry)


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "src")]
    _driver(sys.argv[1], sys.argv[2], sys.argv[3:])

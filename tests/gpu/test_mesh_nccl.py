"""The device mesh under NCCL: tensor 2, context 2 and pipeline 2 at world size 2, data 2 x tensor
2, data 2 x context 2 and data 2 x pipeline 2 at world size 4, each through `scaletune train` with
`num_processes` against the one-GPU run of the same config (fp32, so TF32 stays off:
tests/distributed/test_mesh_parity.py's layouts and bounds). A machine with fewer GPUs than a layout
needs skips it and says how many it has."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity_cases import LAYOUTS, PACKED  # the CPU test's layouts, under NCCL here
from tests.helpers import GRAD_REL, LORA, assert_same_steps, make_config, steps, train

REL = 1e-4


@pytest.fixture(scope="module")
def single_gpu_runs(tiny_model_dir, tmp_path_factory):
    """The one-GPU references, trained when first asked for: (method, packed) -> run dir."""
    cache: dict = {}

    def run(method: str, packed: bool):
        if (method, packed) not in cache:
            tmp = tmp_path_factory.mktemp(f"single-{method}-{packed}")
            cfg = make_config(
                tiny_model_dir,
                tmp / "run",
                model=LORA if method == "lora" else {},
                data=PACKED if packed else {},
                distributed={"strategy": "single", "num_processes": 1},
            )
            train(cfg, tmp)
            cache[method, packed] = tmp / "run"
        return cache[method, packed]

    return run


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mesh_layout_under_nccl(layout, method, packed, single_gpu_runs, tiny_model_dir, tmp_path):
    need, have = LAYOUTS[layout]["num_processes"], torch.cuda.device_count()
    if have < need:
        pytest.skip(f"{layout} under NCCL needs {need} GPUs; this machine has {have}: NOT VERIFIED HERE")
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        model=LORA if method == "lora" else {},
        data=PACKED if packed else {},
        distributed={"strategy": "fsdp", **LAYOUTS[layout]},
    )
    train(cfg, tmp_path)  # distributed.backend auto: NCCL on GPUs
    ref = single_gpu_runs(method, packed)
    assert_same_steps(tmp_path / "run", ref, REL, f"{layout} {method} packed={packed} under NCCL", grad_rel=GRAD_REL)
    assert [m["tokens"] for m in steps(tmp_path / "run")] == [m["tokens"] for m in steps(ref)]

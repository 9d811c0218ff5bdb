"""The documented `socket-ifname` preset on a real two-rank gloo group (moved from
tests/unit/test_network_interfaces.py, whose tests start no process)."""

from __future__ import annotations

import textwrap

import pytest

from scaletune.launch.presets import preset_env
from scaletune.strategies.process_group import host_interfaces
from tests.helpers import run_torchrun

pytestmark = pytest.mark.distributed


_RANK = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from scaletune.env import DistributedEnv
    from scaletune.strategies.process_group import init_process_group, WaitGroup

    init_process_group(DistributedEnv.from_environ(), "gloo", timeout_minutes=1)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    WaitGroup.create(1).barrier()
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
        f.write(f"{t.item()} {os.environ.get('GLOO_SOCKET_IFNAME')}")
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(
    not any(ok and not lo for _, ok, lo in host_interfaces()), reason="no non-loopback interface is up here"
)
def test_exclusion_preset_runs_two_gloo_ranks(tmp_path):
    """The documented `socket-ifname=^docker,lo` on a real two-rank gloo group: the preset's
    variables as the launch writes them, the group started by scaletune's init_process_group."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    preset = preset_env(["socket-ifname=^docker,lo"])
    run = run_torchrun(script, tmp_path, env=preset, unset=("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"), timeout=180)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    results = [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]
    assert all(r[0] == "3.0" and r[1] not in ("None", "lo") for r in results), results

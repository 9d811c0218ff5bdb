"""A tiny distributed payload for the launch system tests (no scaletune training involved).

Each rank checks the variables its launcher set, joins a gloo process group, all-reduces its
rank, and writes `rank-R.json` into OUT_DIR. With `--die-once`, the rank 1 of the first attempt
(TORCHELASTIC_RESTART_COUNT 0) kills itself after writing `killed` to show a restart; with
`--wait-first-attempt`, every rank of the first attempt writes `pid-RANK` and waits (up to 120 s)
for the test to kill one of them.
Usage: python payload_allreduce.py OUT_DIR [--die-once] [--wait-first-attempt] [--sleep S]
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if "--prefix-store" in sys.argv:
    # torchrun keeps its store across restarts; without a per-attempt prefix a restarted rank can
    # read the address the dead attempt's rank published and fail with "Connection refused".
    from datetime import timedelta

    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    store = dist.PrefixStore(f"attempt-{attempt}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
else:
    dist.init_process_group("gloo")
assert dist.get_rank() == rank and dist.get_world_size() == world
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
if "--sleep" in sys.argv:
    time.sleep(float(sys.argv[sys.argv.index("--sleep") + 1]))
if "--wait-first-attempt" in sys.argv and attempt == 0:
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    time.sleep(120)
if "--die-once" in sys.argv and attempt == 0 and rank == 1:
    (out / "killed").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
(out / f"rank-{rank}.json").write_text(
    json.dumps(
        {
            "rank": rank,
            "world_size": world,
            "local_rank": local_rank,
            "sum": t.item(),
            "attempt": attempt,
            "env": {
                k: os.environ.get(k)
                for k in ("NCCL_DEBUG", "MY_SETTING", "OMP_NUM_THREADS", "SCALETUNE_TEST_TOKEN", "MASTER_ADDR")
            },
            "cwd": os.getcwd(),
        }
    )
)
dist.destroy_process_group()

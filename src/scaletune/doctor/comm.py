"""The communication test (`scaletune doctor --comm-test`): collectives checked for the right values,
with bandwidth per message size."""

from __future__ import annotations

import os
import time
from typing import Any

from scaletune.env import DistributedEnv
from scaletune.errors import UserError
from scaletune.strategies.process_group import derive_gloo_ifname


def comm_test(sizes: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 24), iters: int = 5) -> list[dict]:
    """all_reduce, all_gather and reduce_scatter over the launched ranks, each checked for the
    right values, with bandwidth per message size (nccl-tests' algbw and busbw conventions).

    Run under a launcher (`torchrun --nproc_per_node N -m scaletune doctor --comm-test`); gloo on
    CPU (which supports `reduce_scatter_tensor` in torch 2.13), NCCL on GPUs.

    Returns:
        One record per (op, bytes): {"op", "bytes", "ok", "time_s", "algbw_GBps", "busbw_GBps"}.
    """
    import torch
    import torch.distributed as dist

    env = DistributedEnv.from_environ()
    own = not dist.is_initialized()
    if own:
        if env.world_size < 2:
            raise UserError(
                "--comm-test needs several ranks: torchrun --nproc_per_node 2 -m scaletune doctor --comm-test",
                title="no ranks to test",
            )
        if env.cuda_available:
            torch.cuda.set_device(env.device)
        derive_gloo_ifname(os.environ)  # gloo cannot read NCCL's '^' exclusions
        dist.init_process_group("nccl" if env.cuda_available else "gloo")
    try:
        r, w = dist.get_rank(), dist.get_world_size()
        dev = env.device
        out = []
        for size in sizes:
            n = max(w, size // 4 // w * w)  # float32 elements, divisible by the world size
            chunk = n // w
            cases = {
                "all_reduce": (2 * (w - 1) / w),
                "all_gather": ((w - 1) / w),
                "reduce_scatter": ((w - 1) / w),
            }
            for op, factor in cases.items():

                def run(op: str = op, n: int = n, chunk: int = chunk) -> bool:
                    if op == "all_reduce":
                        t = torch.full((n,), float(r + 1), device=dev)
                        dist.all_reduce(t)
                        return bool(torch.all(t == w * (w + 1) / 2))
                    if op == "all_gather":
                        t = torch.empty(n, device=dev)
                        dist.all_gather_into_tensor(t, torch.full((chunk,), float(r), device=dev))
                        want = torch.arange(w, device=dev, dtype=torch.float32).repeat_interleave(chunk)
                        return bool(torch.equal(t, want))
                    src = torch.arange(w, device=dev, dtype=torch.float32).repeat_interleave(chunk) + r
                    t = torch.empty(chunk, device=dev)
                    dist.reduce_scatter_tensor(t, src)
                    return bool(torch.all(t == w * r + w * (w - 1) / 2))

                ok = run()  # warm-up and correctness
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    ok = run() and ok
                if env.cuda_available:
                    torch.cuda.synchronize()
                elapsed = (time.perf_counter() - t0) / iters
                flag = torch.tensor([1.0 if ok else 0.0], device=dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                nbytes = n * 4
                algbw = nbytes / elapsed / 1e9
                out.append(
                    {
                        "op": op,
                        "bytes": nbytes,
                        "ok": bool(flag.item() == 1.0),
                        "time_s": elapsed,
                        "algbw_GBps": algbw,
                        "busbw_GBps": algbw * factor,
                    }
                )
        return out
    finally:
        if own:
            dist.destroy_process_group()


def render_comm(records: list[dict]) -> Any:
    from rich.table import Table

    t = Table(title="communication test")
    for col in ("op", "bytes", "ok", "ms", "algbw GB/s", "busbw GB/s"):
        t.add_column(col)
    for r in records:
        t.add_row(
            r["op"],
            f"{r['bytes']:,}",
            "yes" if r["ok"] else "NO",
            f"{r['time_s'] * 1e3:.3f}",
            f"{r['algbw_GBps']:.3f}",
            f"{r['busbw_GBps']:.3f}",
        )
    return t

"""What a metrics line tells the page (issue 23, "Watch"): the run's total steps, for the progress
bar and its ETA, and each rank's memory, gathered to rank 0 at log time. A real 2-rank DDP run
through `scaletune train` (gloo on the CPU: memory is each process's resident set), checked
against the control each rank can be held to: its own process, alive and measured by psutil."""

from __future__ import annotations

from tests.helpers import make_config, metrics, train


def test_lines_carry_total_steps_and_memory_per_rank(tiny_model_dir, tmp_path):
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        training={"max_steps": 3, "save_every": 0, "log_every": 2, "micro_batch_size": 2},
        distributed={"strategy": "ddp", "num_processes": 2},
    )
    train(cfg, tmp_path)
    lines = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in lines] == [2, 3]  # log_every 2 and the last step
    for r in lines:
        assert r["total_steps"] == 3, r
        assert r["memory_of"] == "process rss", r  # no CUDA here: the process, not a device peak
        mem = r["memory_bytes"]
        # One number per rank, each a whole Python + torch process with the model loaded (over
        # 100 MiB, under 16 GiB): rank 1's came across the group, not a copy of rank 0's zero slot.
        assert len(mem) == 2 and all(100 * 2**20 < m < 16 * 2**30 for m in mem), mem
        assert "gpu_util" not in r  # no GPU: left out, not reported as 0

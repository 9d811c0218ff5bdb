"""The local dispatcher's process tree: what `cancel` ends is every process below the job's,
including those that left its session (torchrun's workers)."""

from __future__ import annotations

import subprocess
import time

from scaletune.serve.dispatch.local import _exists, descendants


def test_descendants_finds_a_grandchild_in_another_session():
    # sh -> setsid sh -> sleep; the inner shell prints the sleep's PID (the control).
    inner = "sleep 30 & echo $!; wait"
    proc = subprocess.Popen(["sh", "-c", f"setsid sh -c '{inner}'"], stdout=subprocess.PIPE, text=True)
    try:
        sleeper = int(proc.stdout.readline())
        tree = descendants(proc.pid)
        assert sleeper in tree and proc.pid not in tree, tree
        assert _exists(sleeper)
    finally:
        for pid in descendants(proc.pid):
            subprocess.run(["kill", str(pid)], check=False)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _exists(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _exists(sleeper)
    assert descendants(proc.pid) == []  # gone (reaped): no tree, no error

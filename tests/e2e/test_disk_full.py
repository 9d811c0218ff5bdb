"""A disk that fills up while `scaletune train` writes a checkpoint: the run's folder on a small
tmpfs of its own (a user and mount namespace, `unshare`), so the disk really is full."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from tests.helpers import REPO_ROOT, make_config, subprocess_env

# The tiny model's checkpoint is about 42 MiB (fp32 weights and two AdamW moments): one fits in
# 64 MiB beside the run's other files, two do not.
SMALL, LARGE = "64m", "160m"

# $1: the mount point, $2: the report file (on the host's disk), $3/$4: the configs; then the
# interpreter. The first run fails at its second save; the tmpfs then grows and the second run
# resumes from the checkpoint the first one left.
SCRIPT = r"""
set -u
mount -t tmpfs -o size="$SMALL" tmpfs "$1" || exit 99
"$5" -m scaletune train "$3" > "$2.first.out" 2> "$2.first.err"; echo "first $?" > "$2"
ls -a "$1/run/checkpoints" >> "$2"; echo "latest $(cat "$1/run/checkpoints/latest")" >> "$2"
mount -o remount,size="$LARGE" "$1"
"$5" -m scaletune train "$4" > "$2.second.out" 2> "$2.second.err"; echo "second $?" >> "$2"
cat "$1/run/metrics.jsonl" > "$2.metrics"
"""


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _namespaces_work(), reason="needs unshare with user and mount namespaces (util-linux)")
def test_a_disk_full_mid_run_names_the_folder_and_the_intact_checkpoint(tiny_model_dir, tmp_path):
    mnt, report = tmp_path / "mnt", tmp_path / "report"
    mnt.mkdir()
    first = make_config(tiny_model_dir, mnt / "run", training={"max_steps": 4, "save_every": 2})
    again = make_config(tiny_model_dir, mnt / "run", training={"max_steps": 4, "save_every": 2, "resume": "auto"})
    (tmp_path / "first.yaml").write_text(yaml.safe_dump(first))
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(again))
    args = [str(mnt), str(report), str(tmp_path / "first.yaml"), str(tmp_path / "again.yaml"), sys.executable]
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", SCRIPT, "bash", *args],
        env=subprocess_env(SMALL=SMALL, LARGE=LARGE),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = report.read_text().splitlines()
    err = (tmp_path / "report.first.err").read_text()
    assert lines[0] == "first 1", err[-3000:]
    # One message, no traceback: what happened, where, the sizes, and what is intact.
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the disk is full: writing the checkpoint under ") and "Traceback" not in err
    assert f"{mnt}/run/checkpoints" in last and "MiB (step-2)" in last and "MiB are free" in last
    assert f"the last intact checkpoint is {mnt}/run/checkpoints/step-2" in last
    # The partial folder is gone; `latest` still names step 2, and the run resumes from it.
    assert ".tmp-step-4" not in lines and "step-2" in lines and "latest step-2" in lines
    second = next(line for line in lines if line.startswith("second"))
    assert second == "second 0", (tmp_path / "report.second.err").read_text()[-3000:]
    steps = [yaml.safe_load(line)["step"] for line in (tmp_path / "report.metrics").read_text().splitlines()]
    assert [s for s in steps if s] == [1, 2, 3, 4]

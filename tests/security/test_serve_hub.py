"""Issue 34, cases 1-3, against a hostile Hugging Face hub on loopback: `scaletune serve` started as
an operator starts it, its `HF_ENDPOINT` a mirror that has turned hostile, its `HF_HOME` holding the
token `hf auth login` stored and the models the operator downloaded.

- Case 1: the hub answers `ETag: "../../../../planted-…"`; huggingface_hub would write each file
  four levels above the cache's blobs (it did, before: beside the service's Hugging Face home).
- Case 2: every request a job makes reaches the hub without the service's credentials (its stored
  token was sent as a Bearer token with each, before).
- Case 3: the hub answers a new commit (another model) for a model in the service's cache; before,
  the service's own check of the job fetched the new commit's config.json into that cache (with
  the service's token), and the job trained a model of the old weights under the new config
  (a size-mismatch failure here); now a job reads that cache in place and writes only its own.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.helpers import ALPACA_5000, LoopbackHub, make_config, subprocess_env
from tests.serve.serve_helpers import free_port, wait_serving, wait_state

STORED_TOKEN, ENV_TOKEN = "hf_stored_by_login_5d0e2a", "hf_in_service_env_c41b07"
OPERATORS, NEWER = "a" * 40, "b" * 40  # victim/tiny's commit in the service's cache, and the hub's answer


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` (links read through) -> its SHA-256: what a job may not change."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_hostile_hub_writes_nothing_outside_a_job_reads_no_credential_and_replaces_no_model(tiny_model_dir, tmp_path):
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    # victim/tiny at its newer commit: another model (its config says a different width).
    newer = {**files, "config.json": files["config.json"].replace(b'"hidden_size": 64', b'"hidden_size": 32')}
    assert newer["config.json"] != files["config.json"]
    hub = LoopbackHub(
        {"victim/tiny": (files, OPERATORS), "attacker/fine": (files, "c" * 40), "attacker/evil": (files, "d" * 40)},
        hostile={"attacker/evil"},
    )
    service_home = tmp_path / "service" / "hf"
    service_home.mkdir(parents=True)
    (service_home / "token").write_text(STORED_TOKEN)
    base = subprocess_env()
    base.pop("HF_HUB_OFFLINE", None)
    base.pop("TRANSFORMERS_OFFLINE", None)
    # The operator's download of victim/tiny into the service's cache, as `hf download` makes it.
    fetch = "from huggingface_hub import hf_hub_download\n" + "".join(
        f"hf_hub_download('victim/tiny', {name!r})\n" for name in files
    )
    subprocess.run(
        [sys.executable, "-c", fetch], env={**base, "HF_HOME": str(service_home), "HF_ENDPOINT": hub.url}, check=True
    )
    shared = service_home / "hub"
    before = _tree(shared)
    assert (shared / "models--victim--tiny" / "refs" / "main").read_text() == OPERATORS
    repos = {"victim/tiny": (newer, NEWER), "attacker/fine": (files, "c" * 40), "attacker/evil": (files, "d" * 40)}
    hub.server.shutdown()
    hub = LoopbackHub(repos, hostile={"attacker/evil"})  # from now on the mirror is hostile

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = tmp_path / "service" / "cwd"  # the service's working directory: jobs start there
    workdir.mkdir()
    argv = [sys.executable, "-m", "scaletune", "serve", "--port", str(port), "--jobs-dir", str(tmp_path / "jobs")]
    argv += ["--read-root", str(ALPACA_5000.parent)]
    env = {
        **base,
        "HF_HOME": str(service_home),
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": ENV_TOKEN,
        "SCALETUNE_DB": f"sqlite:///{tmp_path / 'db.sqlite'}",
    }
    proc = subprocess.Popen(argv, env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(proc, url)
        c = httpx.Client(base_url=url, timeout=120)

        def submit(model: str) -> httpx.Response:
            cfg = make_config(model, "run", training={"max_steps": 2, "save_every": 0})
            return c.post("/api/jobs", json={"config": yaml.safe_dump(cfg)})

        # Case 1: the hostile answers are refused where the config is checked; nothing is written.
        evil = submit("attacker/evil")
        assert evil.status_code == 422, evil.text
        assert "ETag" in evil.text and "nothing was written" in evil.text, evil.text
        assert hub.asked_for("attacker/evil"), "the check never asked the hub: the test proves nothing"

        # Case 3: victim/tiny is trained from the operator's copy, and the hub is never asked.
        victim = submit("victim/tiny")
        assert victim.status_code == 201, victim.text
        done = wait_state(c, victim.json()["id"], {"succeeded", "failed"})
        assert done["state"] == "succeeded", c.get(f"/api/jobs/{done['id']}/logs").text[-2000:]
        assert not hub.asked_for("victim/tiny")

        # A model only the hub has: downloaded into the job's own folder, nowhere else.
        fine = submit("attacker/fine")
        assert fine.status_code == 201, fine.text
        done = wait_state(c, fine.json()["id"], {"succeeded", "failed"})
        assert done["state"] == "succeeded", c.get(f"/api/jobs/{done['id']}/logs").text[-2000:]
        assert hub.asked_for("attacker/fine")
        job_dir = tmp_path / "jobs" / done["id"]
        assert (job_dir / "hf" / "hub" / "models--attacker--fine" / "refs" / "main").read_text() == "c" * 40

        # Nothing of the hub outside the job folders; the service's cache exactly as the operator left it.
        planted = sorted(str(p) for p in tmp_path.rglob("planted-*"))
        assert not planted, planted
        assert _tree(shared) == before
        assert not (shared / "models--attacker--fine").exists()
        # Case 2: no request carried a credential of the service's.
        sent = {auth for _, _, auth in hub.seen}
        assert sent == {None}, sent
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        hub.server.shutdown()
    # The service's own working directory holds nothing a job wrote (its next `python -m scaletune`
    # would start there; PYTHONSAFEPATH keeps it off sys.path as well).
    assert sorted(os.listdir(workdir)) == [], os.listdir(workdir)

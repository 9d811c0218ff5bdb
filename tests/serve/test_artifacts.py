"""`GET /api/jobs/{id}/artifacts/{path}`: the allow-list (checked once, in app.py, before any
dispatcher is asked), a local run directory served as before (files as attachments, folders
listed, links out of their entry refused), and a Modal job's artifacts read from its volume through
`ModalDispatcher.artifact`.

Modal's server cannot be reached here. What runs for real: the SDK's `Volume.from_name` and its
hydration up to the network (no credentials: the SDK's AuthError; dummy credentials: a TCP
listener that accepts the SDK's connection and never answers, so the request's own deadline
ends it), each answered 502 naming the volume, the path and `modal volume get`, with no token in
it. The listing and streaming logic is shown on real bytes with `StandInVolume`, an in-process
object with the SDK Volume's `listdir.aio` / `read_file` and its real `FileEntry` values: it
stands in for Modal's server and is not Modal. Unverified: Modal's real answers (the paths its
`listdir` returns, NotFoundError for a missing path, `read_file`'s chunks)."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scaletune.serve.app import create_app
from scaletune.serve.jobs.db import Job
from scaletune.serve.jobs.dispatch.base import Dispatcher
from scaletune.serve.jobs.service import JobService
from tests.serve.serve_helpers import TEST_POLICY, plant_job

modal = pytest.importorskip("modal")
from modal.types import FileEntry, FileEntryType  # noqa: E402

from scaletune.serve.jobs.dispatch.modal import ModalDispatcher  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3


@pytest.fixture
def svc(tmp_path, monkeypatch):
    for k in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_SERVER_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "no-modal.toml"))
    s = JobService(
        f"sqlite:///{tmp_path / 'db.sqlite'}",
        tmp_path / "jobs",
        "http://127.0.0.1:9",
        policy=TEST_POLICY,
        public_url="https://jobs.example.com",
    )
    yield s
    s.engine.dispose()


def fill_run(run: Path, outside: Path) -> None:
    """A run directory as a run leaves it, with a file outside the allow-list and two links out."""
    (run / "final" / "sub").mkdir(parents=True, exist_ok=True)
    (run / "final" / "config.json").write_text('{"a": 1}')
    (run / "final" / "sub" / "w.bin").write_bytes(b"\x00\x01" * 100)
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "state.pt").write_bytes(b"ckpt")
    (run / "loss.png").write_bytes(PNG)
    (run / "secret.txt").write_text("not an artifact")
    outside.write_text("outside the run")
    (run / "final" / "escape").symlink_to(outside)  # a link in a listed folder
    (run / "metrics.jsonl").symlink_to(outside)  # an allow-listed name that leads out


def planted(svc: JobService, run: Path, target: str) -> str:
    job_id = plant_job(svc, run, resources={"gpu_count": 1, "volume": "v1"})
    with svc.Session() as s:
        s.get(Job, job_id).target = target
        s.commit()
    return job_id


REFUSED = ("secret.txt", "final/../secret.txt", "../../etc/passwd", "final/../../x", "%2e%2e/%2e%2e/etc/passwd")


def test_local_artifacts(svc, tmp_path):
    """A local run directory: the same answers the route gave before it asked its dispatcher."""
    run = tmp_path / "run"
    run.mkdir()
    fill_run(run, tmp_path / "outside.txt")
    job_id = planted(svc, run, "local")
    with TestClient(create_app(svc, start=False), base_url="http://127.0.0.1") as c:
        get = lambda p: c.get(f"/api/jobs/{job_id}/artifacts/{p}")  # noqa: E731
        assert get("final").json() == ["final/config.json", "final/sub/w.bin"]  # the link left out
        assert get("checkpoints/step-2").json() == ["checkpoints/step-2/state.pt"]
        r = get("loss.png")
        assert r.status_code == 200 and r.content == PNG
        assert r.headers["content-disposition"] == 'attachment; filename="loss.png"'
        assert get("final/sub/w.bin").content == b"\x00\x01" * 100
        for p in ("final/escape", "metrics.jsonl", *REFUSED):
            assert get(p).status_code == 404, p
        r = get("config.yaml")
        assert r.status_code == 404 and r.json()["detail"] == "config.yaml: not written (yet)"
    assert (run / "secret.txt").is_file()  # control: refused by the allow-list, not for being absent


def test_modal_artifact_without_credentials_is_502(svc, tmp_path):
    """No Modal credentials: the SDK refuses before the network (AuthError); the answer is 502 and
    says where the file is and how to fetch it, and a local folder of that name is not listed."""
    run = tmp_path / "run"
    run.mkdir()
    fill_run(run, tmp_path / "outside.txt")
    modal_id, local_id = planted(svc, run, "modal"), planted(svc, tmp_path / "run2", "local")
    fill_run(tmp_path / "run2", tmp_path / "outside2.txt")
    with TestClient(create_app(svc, start=False), base_url="http://127.0.0.1") as c:
        r = c.get(f"/api/jobs/{modal_id}/artifacts/final")
        control = c.get(f"/api/jobs/{local_id}/artifacts/final")
        refused = [c.get(f"/api/jobs/{modal_id}/artifacts/{p}").status_code for p in REFUSED]
    assert control.status_code == 200 and "final/config.json" in control.json()  # the same tree, local
    assert r.status_code == 502, r.text
    detail = r.json()["detail"]
    assert "Modal volume v1 under run/final" in detail and "`modal volume get v1 run/final`" in detail, detail
    assert "modal token new" in detail, detail
    assert refused == [404] * len(REFUSED)  # the allow-list answers before Modal is asked


def test_unreachable_modal_is_502_in_time_without_the_token(svc, tmp_path, monkeypatch):
    """Dummy credentials and a Modal server address where a listener accepts and never answers: the
    SDK connects (seen by the listener), the request ends at `volume_timeout_s` with a 502 naming
    the volume, the path and the command, and neither token part is in the answer."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    token_id, token_secret = f"ak-{secrets.token_hex(8)}", f"as-{secrets.token_hex(16)}"
    monkeypatch.setenv("MODAL_TOKEN_ID", token_id)
    monkeypatch.setenv("MODAL_TOKEN_SECRET", token_secret)
    monkeypatch.setenv("MODAL_SERVER_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
    d = ModalDispatcher()
    d.volume_timeout_s = 2.0
    svc.dispatchers["modal"] = d
    job_id = planted(svc, tmp_path / "run", "modal")
    try:
        with TestClient(create_app(svc, start=False), base_url="http://127.0.0.1") as c:
            t0 = time.monotonic()
            r = c.get(f"/api/jobs/{job_id}/artifacts/loss.png")
            took = time.monotonic() - t0
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert accepted, "the SDK never connected: the 502 did not come from the network boundary"
    assert r.status_code == 502 and 2.0 <= took < 15, (r.status_code, took, r.text)
    detail = r.json()["detail"]
    assert "did not list in 2 s" in detail and "`modal volume get v1 run/loss.png`" in detail, detail
    answer = r.text + repr(dict(r.headers))
    assert token_id not in answer and token_secret not in answer and token_secret[3:] not in answer


class StandInVolume:
    """STANDS IN FOR MODAL'S SERVER (not reachable here): the SDK Volume's `listdir.aio` and
    `read_file`, answered from a local folder as Modal documents them (paths from the volume's
    root; a file's path lists that file alone; NotFoundError for a missing path; chunks of bytes),
    with the SDK's real FileEntry values. It records what it was asked."""

    def __init__(self, root: Path) -> None:
        self.root, self.asked = root, []
        vol = self

        class Listdir:
            async def aio(self, path: str, *, recursive: bool = False) -> list[FileEntry]:
                return vol.entries(path, recursive)

        self.listdir = Listdir()

    def entries(self, path: str, recursive: bool) -> list[FileEntry]:
        assert "*" not in path  # the SDK refuses globs (InvalidError)
        self.asked.append(path)
        p = self.root / path

        def entry(q: Path) -> FileEntry:
            kind = (
                FileEntryType.SYMLINK
                if q.is_symlink()
                else FileEntryType.DIRECTORY
                if q.is_dir()
                else FileEntryType.FILE
            )
            return FileEntry(path=q.relative_to(self.root).as_posix(), type=kind, mtime=0, size=q.lstat().st_size)

        if p.is_symlink() or p.is_file():
            return [entry(p)]
        if not p.is_dir():
            raise modal.exception.NotFoundError(f"No such file or directory: {path}")
        return [entry(q) for q in sorted(p.rglob("*") if recursive else p.iterdir())]

    def read_file(self, path: str):
        self.asked.append(path)
        data = (self.root / path).read_bytes()
        for i in range(0, len(data), 100):
            yield data[i : i + 100]


class StandInModal(ModalDispatcher):
    def __init__(self, volume: StandInVolume) -> None:
        self.vol, self.names = volume, []

    def volume(self, name: str):
        self.names.append(name)
        return self.vol


def test_modal_artifacts_listed_and_streamed_from_the_volume(svc, tmp_path):
    """Through `ModalDispatcher.artifact` on a stand-in volume holding the run directory: a folder
    lists what the local default lists for the same tree (control), a file streams its bytes with
    its size and name, links are not served, and refused paths never reach the volume."""
    tree = tmp_path / "volume" / "run"  # the run directory's name on the volume: volume_run_name
    tree.mkdir(parents=True)
    fill_run(tree, tmp_path / "outside.txt")
    vol = StandInVolume(tmp_path / "volume")
    svc.dispatchers["modal"] = d = StandInModal(vol)
    job_id = planted(svc, tmp_path / "run", "modal")  # an empty local run directory
    control = Dispatcher().artifact(svc.files(svc.get(job_id)), str(tree), "final")
    with TestClient(create_app(svc, start=False), base_url="http://127.0.0.1") as c:
        get = lambda p: c.get(f"/api/jobs/{job_id}/artifacts/{p}")  # noqa: E731
        for p in (*REFUSED, "final/*"):
            assert get(p).status_code == 404, p
        assert vol.asked == []  # the allow-list (and a glob) answered before the volume was asked
        assert get("final").json() == control == ["final/config.json", "final/sub/w.bin"]
        assert get("checkpoints").json() == ["checkpoints/step-2/state.pt"]
        r = get("loss.png")
        assert r.status_code == 200 and r.content == PNG and len(PNG) > 100  # several chunks
        assert r.headers["content-length"] == str(len(PNG)) and r.headers["content-type"] == "image/png"
        assert r.headers["content-disposition"] == 'attachment; filename="loss.png"'
        assert get("final/sub/w.bin").content == b"\x00\x01" * 100
        for p in ("final/escape", "metrics.jsonl", "config.yaml", "final/nothing"):
            r = get(p)
            assert r.status_code == 404, (p, r.text)
        assert r.json()["detail"] == "final/nothing: not written (yet)"
    assert set(d.names) == {"v1"}  # the job's own volume
    assert "run/loss.png" in vol.asked and all(a.startswith("run/") for a in vol.asked)

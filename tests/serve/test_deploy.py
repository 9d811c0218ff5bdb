"""What a deployment relies on, against the real service (tests/serve/conftest.py's `server`):
`/healthz` without a token, and the logs endpoint refusing a rank filter it cannot honour.
Postgres, the start line and /healthz's 503 are in test_db.py."""

from __future__ import annotations

import httpx

from tests.serve.serve_helpers import client, plant_job

# What torchrun writes to the one log of a 2-rank local job: rank 0 prints for the run, and only an
# uncaught error's traceback is prefixed with its rank (torch's excepthook; no --tee).
LOG = "[scaletune] starting 2 processes\nstep 1 loss 2.0\n[rank1]: Traceback (most recent call last):\n[rank1]: boom\n"


def test_healthz_answers_without_a_token(server):
    # The service has tokens (the fixture made three): everything else needs one, /healthz does not.
    assert httpx.get(f"{server.url}/api/jobs").status_code == 401
    resp = httpx.get(f"{server.url}/healthz")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_logs_refuse_a_rank_filter_they_cannot_honour(server, tmp_path):
    job_id = plant_job(server.svc, tmp_path / "run")
    (server.svc.home / job_id / "train.log").write_text(LOG)
    with client(server, server.read) as c:
        assert c.get(f"/api/jobs/{job_id}/logs").text == LOG
        resp = c.get(f"/api/jobs/{job_id}/logs", params={"rank": 1})
        assert resp.status_code == 422, resp.text
        err = resp.json()
        (line,) = err["problems"]
        assert line.startswith("query.rank: ranks are not separated in this log"), err
        # The same shape as any other bad query value (the service's one 422 shape).
        bad = c.get(f"/api/jobs/{job_id}/logs", params={"offset": -1}).json()
        assert set(bad) == set(err) == {"detail", "problems"} and bad["problems"][0].startswith("query.offset: ")


def test_log_reads_by_byte_offset_add_up_to_the_file(server, tmp_path):
    """A reader that asks from its offset plus the bytes it got (`remote logs --follow` does) ends
    with the log's exact bytes: characters cut between reads and invalid UTF-8 (a crashed
    process's partial write) included. Decoded text would have replaced both with U+FFFD."""
    job_id = plant_job(server.svc, tmp_path / "run")
    raw = "step 1 loss 2.0 ✓ — ok\n".encode() * 3 + b"\xff\xfe torn write\n" + "ünïcödé tail".encode()
    (server.svc.home / job_id / "train.log").write_bytes(raw)
    got, offset = b"", 0
    with client(server, server.read) as c:
        while chunk := c.get(f"/api/jobs/{job_id}/logs", params={"offset": offset, "limit": 5}).content:
            got, offset = got + chunk, offset + len(chunk)
        assert c.get(f"/api/jobs/{job_id}/logs").headers["content-type"] == "text/plain; charset=utf-8"
    assert got == raw


def _stream(c: httpx.Client, job_id: str, read_timeout: float) -> list[str]:
    """The raw lines of the job's event stream until the service ends it."""
    with c.stream("GET", f"/api/jobs/{job_id}/events", timeout=httpx.Timeout(30, read=read_timeout)) as resp:
        assert resp.status_code == 200
        return list(resp.iter_lines())


def test_the_event_stream_ends_after_a_terminal_state(server, tmp_path):
    """A script following a finished job gets an `end` event and the end of the stream (it was held
    open with a heartbeat every 10 s, forever); a live job's stream stays open."""
    with client(server, server.read) as c:
        for state in ("succeeded", "failed", "cancelled", "stopped"):
            done = plant_job(server.svc, tmp_path / state, state=state)
            lines = _stream(c, done, read_timeout=8)
            assert "event: end" in lines and f'data: {{"state": "{state}"}}' in lines, lines
            assert "retry: 10000" in lines  # a browser's EventSource asks again every 10 s
        live = plant_job(server.svc, tmp_path / "live", state="running")
        try:
            lines = _stream(c, live, read_timeout=3)
        except httpx.ReadTimeout:
            lines = None  # still open after 3 s: what a live job's stream does
        assert lines is None, f"the stream of a running job ended: {lines}"

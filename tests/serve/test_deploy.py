"""What a deployment relies on, against the real service (tests/serve/conftest.py's `server`):
`/healthz` without a token, and the logs endpoint refusing a rank filter it cannot honour.
Postgres, the start line and /healthz's 503 are in test_db.py."""

from __future__ import annotations

import httpx

from tests.serve.conftest import client, plant_job

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

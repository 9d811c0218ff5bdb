"""Load on loopback: concurrent API clients polling while submitted jobs train, at most 2 running at
once. Every job ends, every record and metric line is there, no request fails; the API's latency
is printed. CI proves it at a size it can pay for (8 clients, 4 jobs: under a minute on 2 cores);
SCALETUNE_LOAD_TEST=1 runs the measurement docs/serve.md states (50 clients, 20 jobs)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import yaml

from tests.helpers import make_config
from tests.serve.serve_helpers import Server, client

# The measurement (SCALETUNE_LOAD_TEST=1 pytest -s tests/serve/test_load.py): 20 training processes,
# minutes of CPU; the proof in CI: the same assertions with fewer clients and jobs.
MEASURE = os.environ.get("SCALETUNE_LOAD_TEST") == "1"
CLIENTS, JOBS, LIMIT, STEPS = (50, 20, 2, 2) if MEASURE else (8, 4, 2, 2)


def test_clients_poll_while_jobs_train_under_the_limit(tiny_model_dir, tmp_path):
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs", max_concurrent=LIMIT)
    latencies: list[float] = []
    errors: list[str] = []
    job_ids: list[str] = []
    done = threading.Event()
    peak = [0]

    def config(i: int) -> str:
        cfg = make_config(tiny_model_dir, tmp_path / "runs" / f"job-{i}")
        cfg["training"].update(max_steps=STEPS, save_every=0, micro_batch_size=8)
        return yaml.safe_dump(cfg)

    def worker(i: int) -> None:
        c = client(srv, None)

        def call(method: str, url: str, **kw):
            t = time.perf_counter()
            r = c.request(method, url, **kw)
            latencies.append(time.perf_counter() - t)
            if r.status_code >= 400:
                errors.append(f"{method} {url}: {r.status_code} {r.text[:200]}")
            return r

        if i < JOBS:
            job_ids.append(call("POST", "/api/jobs", json={"config": config(i)}).json()["id"])
        while not done.is_set():
            jobs = call("GET", "/api/jobs").json()
            peak[0] = max(peak[0], sum(j["state"] in ("starting", "running", "stopping") for j in jobs))
            if job_ids:
                jid = job_ids[i % len(job_ids)]
                call("GET", f"/api/jobs/{jid}")
                call("GET", f"/api/jobs/{jid}/metrics")
            time.sleep(0.2)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        c = client(srv, None)
        loads: list[float] = []  # the machine's 1-minute load average, sampled each second
        while time.monotonic() - start < 1500:
            loads.append(os.getloadavg()[0])
            jobs = c.get("/api/jobs").json()
            if len(jobs) == JOBS and all(j["state"] in ("succeeded", "failed", "cancelled") for j in jobs):
                break
            time.sleep(1)
        done.set()
        for t in threads:
            t.join(timeout=60)
        wall = time.monotonic() - start
        jobs = {j["id"]: j for j in c.get("/api/jobs").json()}
        assert sorted(jobs) == sorted(job_ids) and len(jobs) == JOBS
        assert all(j["state"] == "succeeded" for j in jobs.values()), [
            j for j in jobs.values() if j["state"] != "succeeded"
        ]
        assert peak[0] <= LIMIT
        for jid, j in jobs.items():
            written = [json.loads(x) for x in open(f"{j['run_dir']}/metrics.jsonl").read().splitlines()]
            assert [m["step"] for m in written] == list(range(1, STEPS + 1))
            assert c.get(f"/api/jobs/{jid}/metrics").json() == written
        assert not errors, errors[:5]
        q = statistics.quantiles(latencies, n=100)
        print(
            f"\n[load] {CLIENTS} clients, {JOBS} jobs, limit {LIMIT}: {len(latencies)} requests in {wall:.0f} s; "
            f"latency p50 {q[49] * 1000:.0f} ms, p95 {q[94] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms; "
            f"peak running {peak[0]}; load average (1 min) median {statistics.median(loads):.1f}, "
            f"max {max(loads):.1f} on {os.cpu_count()} cores"
        )
    finally:
        done.set()
        srv.cancel_all()
        srv.stop()

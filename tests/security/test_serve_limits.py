"""The service's limits (issue 21, items 3 and 4): artifact paths confined after normalisation,
request size and nesting, bounded integers, validated reports, report tokens that end with their
job, and logs read by range."""

from __future__ import annotations

import socket
import time
import tracemalloc

import httpx
import pytest

from scaletune.serve.edge.auth import create_token
from tests.serve.serve_helpers import Server, client, free_port, plant_job, wait_serving


@pytest.fixture(scope="module")
def srv(module_tmp_path):
    s = Server(f"sqlite:///{module_tmp_path / 'db.sqlite'}", module_tmp_path / "jobs")
    s.read = create_token(s.svc.Session, "read")
    s.submit = create_token(s.svc.Session, "submit")
    yield s
    s.stop()


def test_artifact_paths_normalised_and_confined(srv, tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "private.txt").write_text("not an artifact")
    job = plant_job(srv.svc, run)
    c = client(srv, srv.read)
    assert c.get(f"/api/jobs/{job}/artifacts/final/config.json").status_code == 200  # the control
    for bad in (
        "final/%2e%2e/private.txt",
        "final/%2E%2E/private.txt",
        "checkpoints/%2e%2e/private.txt",
        "final/%00",
        "final/config.json%00.png",
        "final%5c..%5cprivate.txt",
    ):
        r = c.get(f"/api/jobs/{job}/artifacts/{bad}")
        assert r.status_code == 404, (bad, r.status_code, r.text[:200])


def test_request_size_and_nesting(srv):
    c = client(srv, srv.submit)
    big = "x: '" + "a" * (64 * 2**20) + "'\n"
    t = time.monotonic()
    try:
        r = c.post("/api/jobs", json={"config": big, "dry_run": True}, timeout=120)
        assert r.status_code == 413, r.text[:200]
    except httpx.WriteError:
        pass  # refused while it was still being sent: the connection closed early
    assert time.monotonic() - t < 20
    for text in ("a: " + "[" * 5000 + "]" * 5000, "a:\n" + "".join(" " * i + "- \n" for i in range(1, 1500))):
        r = c.post("/api/jobs", json={"config": text, "dry_run": True})
        assert r.status_code == 422 and "nested" in r.text, r.text[:300]
    # Aliases nest too: each anchor holds the last, 200 deep in 200 lines.
    chain = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 200))
    r = c.post("/api/jobs", json={"config": chain, "dry_run": True})
    assert r.status_code == 422 and "nested" in r.text, r.text[:300]
    r = c.post("/api/jobs", json={"config": "x: 1", "overrides": ["model.x=" + "[" * 3000], "dry_run": True})
    assert r.status_code == 422, r.text[:300]


def _post_headers_only(srv, path: str, token: str | None, length: int = 4 * 2**20) -> tuple[socket.socket, bytes]:
    """Send an unsafe request's headers (a 4 MiB body announced, none of it sent) and read for 3 s:
    what the service answered before the body, and the open socket."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=3)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    sock.sendall(head.encode())
    try:
        answer = sock.recv(4096)
    except TimeoutError:
        answer = b""
    return sock, answer


def test_an_unsafe_request_without_a_credential_is_refused_before_its_body(srv, tmp_path):
    """Issue 34 (S3): a body was read into memory before the route checked the token, so 60
    token-less requests of 4 MiB held 250 MB. Now one without a token, or with a wrong one (API or
    report token), is answered 401 before a byte of its body is sent. The control: with a live
    submit token the service waits for the body (no answer in 3 s), and answers once it comes."""
    job = plant_job(srv.svc, tmp_path / "run")
    for path, token in (
        ("/api/jobs", None),
        ("/api/jobs", "not-a-token"),
        ("/api/data/preview", "st_" + "0" * 40),
        (f"/api/jobs/{job}/report", "wrong-report-token"),
    ):
        sock, answer = _post_headers_only(srv, path, token)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 401"), (path, token, answer[:200])
    sock, answer = _post_headers_only(srv, "/api/jobs", srv.submit, length=2)
    try:
        assert answer == b"", answer[:200]  # waiting for the body
        sock.sendall(b"{}")
        sock.settimeout(30)
        assert sock.recv(4096).startswith(b"HTTP/1.1 422")  # read, then refused for what it holds
    finally:
        sock.close()


def test_integers_bounded_and_reports_validated(srv, tmp_path):
    token = "stj_test_" + "x" * 20
    job = plant_job(srv.svc, tmp_path / "run", state="running", token=token)
    c = client(srv, srv.read)
    assert c.get(f"/api/jobs/{job}/metrics", params={"since_step": 10**30}).status_code == 422
    assert c.get(f"/api/jobs/{job}/metrics", params={"since_step": -1}).status_code == 422
    r = c.get(f"/api/jobs/{job}/events", headers={"Last-Event-ID": str(10**30)})
    assert r.status_code == 400, r.text[:200]
    assert c.get(f"/api/jobs/{job}/logs", params={"rank": 10**30}).status_code == 422
    report = client(srv, token)
    for data in ({"step": 10**30, "loss": 1.0}, {"step": "1"}, {"step": 1, "x": "a" * 10_000}, {"step": -1}):
        r = report.post(f"/api/jobs/{job}/report", json={"events": [{"kind": "metric", "data": data}]})
        assert r.status_code == 422, (data, r.text[:200])
    r = report.post(f"/api/jobs/{job}/report", json={"events": [{"kind": "checkpoint", "data": {"step": 1}}]})
    assert r.status_code == 422, r.text[:200]
    ok = {"events": [{"kind": "metric", "data": {"step": 1, "loss": 2.0}}]}
    assert report.post(f"/api/jobs/{job}/report", json=ok).json() == {"accepted": 1}  # the control
    assert [m["step"] for m in c.get(f"/api/jobs/{job}/metrics").json()] == [1]


def test_report_token_ends_with_its_job(srv, tmp_path):
    token = "stj_test_" + "y" * 20
    job = plant_job(srv.svc, tmp_path / "run", state="running", token=token)
    post = {"events": [{"kind": "metric", "data": {"step": 1, "loss": 2.0}}]}
    assert client(srv, token).post(f"/api/jobs/{job}/report", json=post).status_code == 200
    assert client(srv, srv.submit).post(f"/api/jobs/{job}/cancel").json()["state"] == "cancelled"
    forged = {"events": [{"kind": "metric", "data": {"step": 2, "loss": 0.0}}]}
    assert client(srv, token).post(f"/api/jobs/{job}/report", json=forged).status_code == 401
    assert [m["step"] for m in client(srv, srv.read).get(f"/api/jobs/{job}/metrics").json()] == [1]


def test_logs_read_by_range(srv, tmp_path):
    """A 96 MB log: one request holds about its answer (1 MiB) in memory, not the log."""
    job = plant_job(srv.svc, tmp_path / "run")
    log = srv.svc.home / job / "train.log"
    line = b"[rank0]: " + b"x" * 90 + b"\n"
    with open(log, "wb") as f:
        for _ in range(96):
            f.write(line * (2**20 // len(line)))
        f.write(b"the last line\n")
    c = client(srv, srv.read)
    tracemalloc.start()
    try:
        r = c.get(f"/api/jobs/{job}/logs")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.status_code == 200 and r.text.endswith("the last line\n")
    assert len(r.content) <= 2**20
    assert peak < 24 * 2**20, f"{peak / 2**20:.0f} MiB held for one /logs request"
    head = c.get(f"/api/jobs/{job}/logs", params={"offset": 0, "limit": 100})
    assert head.content == line[:100]


def test_compare_reads_no_config_over_its_bound(srv, tmp_path):
    """Issue 34 (S2): a read token's `/compare` of a job with a large config cost the service
    seconds of CPU per request (PyYAML parsing it, then flattening it). A config.yaml over 256 KiB is
    not read: the page says so in the job's column, for well under a CPU-second of the service's (its
    threads are this process's). The control: two small configs, their difference shown."""
    runs = {}
    for name, lr in (("a", 0.001), ("b", 0.002)):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        (runs[name] / "config.yaml").write_text(f"training:\n  learning_rate: {lr}\n")
    runs["big"] = tmp_path / "big"
    runs["big"].mkdir()
    (runs["big"] / "config.yaml").write_text("".join(f"k{i}: {{x: [{i}, {i}], y: v{i}}}\n" for i in range(120_000)))
    ids = {name: plant_job(srv.svc, run) for name, run in runs.items()}
    c = client(srv, srv.read)
    r = c.get(f"/compare?ids={ids['a']},{ids['b']}")
    assert r.status_code == 200 and "training.learning_rate" in r.text, r.text[-500:]
    cpu = time.process_time()
    r = c.get(f"/compare?ids={ids['a']},{ids['big']}", timeout=120)
    spent = time.process_time() - cpu
    assert r.status_code == 200 and "over the 262,144 compared" in r.text, r.text[-500:]
    assert spent < 1.0, f"the compare page spent {spent:.1f} CPU-s on one large config"


def test_form_fields_nested_too_deep_are_422(srv):
    """`/api/config/apply` with a field nested 900 deep answered 500 (issue 34, S3): now 422, and
    a field at an ordinary depth still applies (the control)."""
    c = client(srv, srv.read)
    deep: object = 1
    for _ in range(900):
        deep = {"k": deep}
    r = c.post("/api/config/apply", json={"config": "seed: 1\n", "fields": {"data.train": deep}})
    assert r.status_code == 422 and "nested" in r.text, (r.status_code, r.text[:300])
    ok = c.post("/api/config/apply", json={"config": "seed: 1\n", "fields": {"seed": 7}})
    assert ok.status_code == 200 and "seed: 7" in ok.json()["config"], ok.text[:300]


def test_concurrent_first_previews_all_answer(tiny_model_dir, tmp_path):
    """Twelve data previews at once on a freshly started `scaletune serve` (nothing of transformers
    imported yet): none fails, and each, retried while the two preview slots are busy (its 503 says
    Retry-After), answers 200 with the same preview (issue 34: 11 of 12 were 500, an ImportError
    from a module another request thread was still importing)."""
    import json
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import yaml

    from tests.helpers import ALPACA_5000, REPO_ROOT, make_config, subprocess_env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "scaletune", "serve", "--port", str(port), "--jobs-dir", str(tmp_path / "jobs")]
    argv += ["--read-root", str(tmp_path), "--read-root", str(tiny_model_dir.parent)]
    env = subprocess_env(SCALETUNE_DB=f"sqlite:///{tmp_path / 'db.sqlite'}")
    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(proc, url)
        records = json.loads(ALPACA_5000.read_text())[:50]
        body = "".join(json.dumps(r) + "\n" for r in records).encode()
        up = httpx.post(url + "/api/data", params={"name": "a.jsonl"}, content=body, timeout=120)
        assert up.status_code in (200, 201), up.text
        cfg = yaml.safe_dump(make_config(tiny_model_dir, "run"))

        def preview(_):
            deadline = time.monotonic() + 170
            while True:
                r = httpx.post(url + "/api/data/preview", json={"file": "a.jsonl", "config": cfg}, timeout=180)
                if r.status_code != 503 or time.monotonic() > deadline:
                    return r
                assert r.headers.get("retry-after") == "5", r.headers
                time.sleep(0.5)  # sooner than Retry-After asks: the test's own patience

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(preview, range(12)))
        assert [r.status_code for r in answers] == [200] * 12, [r.text[:200] for r in answers if r.status_code != 200]
        assert len({json.dumps(r.json(), sort_keys=True) for r in answers}) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_connections_are_bounded_half_sent_ones_too(tmp_path):
    """Issue 34 (S3, connection limits): `scaletune serve --max-connections 8`. Seven connections
    that send half a request and wait (a slow-loris client) hold the service at its bound: the next
    request is answered 503 at once, not queued behind them; once they close, 200 (the control).
    Before, the service took every connection an address opened, with no bound at all."""
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT, subprocess_env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "scaletune", "serve", "--port", str(port), "--max-connections", "8"]
    argv += ["--jobs-dir", str(tmp_path / "jobs")]
    env = subprocess_env(SCALETUNE_DB=f"sqlite:///{tmp_path / 'db.sqlite'}")
    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    held: list[socket.socket] = []
    try:
        wait_serving(proc, url)
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        for _ in range(7):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line that ends it
            held.append(s)
        time.sleep(0.5)
        t = time.monotonic()
        assert httpx.get(url + "/healthz", timeout=10).status_code == 503
        assert time.monotonic() - t < 5
        for s in held:
            s.close()
        held.clear()
        deadline = time.monotonic() + 10
        while (code := httpx.get(url + "/healthz", timeout=10).status_code) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert code == 200
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_child_checks_are_bounded(srv, tmp_path, monkeypatch):
    """A config naming a hub id is checked in a child process (its download must not be the
    service's: tests/security/test_serve_hub.py), and each child costs ~0.4 GB and seconds of CPU.
    Ten dry runs at once: never more than four children alive (`validate.CHECK_SLOTS`); with no
    wait allowed (`CHECK_WAIT_S` 0 here) the others are answered 503 with Retry-After, leaving no job
    folder; the checked ones are answered, each naming the model (offline here: not found)."""
    import concurrent.futures

    import psutil
    import yaml

    from scaletune.serve.jobs import validate
    from tests.helpers import make_config

    monkeypatch.setattr(validate, "CHECK_WAIT_S", 0)
    cfg = yaml.safe_dump(make_config("owner/not-cached", "run"))
    alive: list[int] = []
    done = False

    def is_check(p: psutil.Process) -> bool:
        try:
            return "scaletune.serve.jobs.validate" in " ".join(p.cmdline())
        except psutil.Error:  # ended between the listing and the reading
            return False

    def checking(p: psutil.Process) -> bool:
        # A check's own short-lived children (a fork before its exec, e.g. ctypes' library lookup) carry
        # its command line too: one slot is one check process, counted where its parent is not a check.
        try:
            parent = p.parent()
            return is_check(p) and (parent is None or not is_check(parent))
        except psutil.Error:
            return False

    def count() -> None:
        me = psutil.Process()
        while not done:
            alive.append(sum(checking(p) for p in me.children(recursive=True)))
            time.sleep(0.05)

    before = set((srv.home).iterdir()) if srv.home.exists() else set()
    with concurrent.futures.ThreadPoolExecutor(11) as pool:
        watcher = pool.submit(count)
        answers = list(
            pool.map(
                lambda _: client(srv, srv.submit).post("/api/jobs", json={"config": cfg, "dry_run": True}, timeout=120),
                range(10),
            )
        )
        done = True
        watcher.result()
    codes = sorted(r.status_code for r in answers)
    assert max(alive) <= 4 and max(alive) >= 1, max(alive)
    assert codes.count(503) >= 1 and all(c in (422, 503) for c in codes), codes
    busy = next(r for r in answers if r.status_code == 503)
    assert busy.headers["retry-after"] == "5" and "config-check slot" in busy.text, busy.text
    assert all("owner/not-cached" in r.text for r in answers if r.status_code == 422)
    assert set(srv.home.iterdir()) == before  # dry runs and refusals leave no job folder

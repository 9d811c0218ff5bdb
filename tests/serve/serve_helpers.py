"""What the serve tier's tests share (and the security tier's tests of the service): a real
`scaletune serve` on loopback (uvicorn in a thread, SQLite in tmp), its client and SSE reader, job
records planted in its database, headless Chromium, nginx serving it under a prefix, and the
password of the test Postgres. The fixtures built on them are in tests/serve/conftest.py."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from sqlalchemy import create_engine, text

from scaletune.serve.app import create_app
from scaletune.serve.edge.policy import Policy
from scaletune.serve.jobs.db import database_url
from scaletune.serve.jobs.service import JobService
from tests.helpers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared"  # the data sets and tokenizers of the tests

# The admin settings of the test services: the tests' models, data and runs live in the temporary
# folder and the repository. tests/security/test_serve_*.py start services with the default Policy().
TEST_POLICY = Policy(
    read_roots=(tempfile.gettempdir(), str(REPO_ROOT), str(SHARED_DATA)), write_roots=(tempfile.gettempdir(),)
)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
NO_BROWSER = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"


def need(what: object, reason: str) -> None:
    """Skip without `what`, saying why; under CI=true fail instead: .ci/run installs Chromium, nginx
    and Postgres, and CI must run these tests rather than skip them."""
    if not what:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}")
        pytest.skip(reason)


def headless_chromium(profile: Path):
    """A Selenium driver of Debian's headless Chromium (no browser download), its profile in
    `profile`; the caller quits it. Skips (fails under CI=true) without Chromium."""
    need(CHROMIUM and DRIVER, NO_BROWSER)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # No background networking: this machine's closed network refuses Chromium's own connections.
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1200,1000",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=opts)


def dom(driver, css: str, attr: str | None = None, *, prop: str | None = None, visible: bool = False) -> list:
    """The text of every element matching `css` in document order, or its attribute `attr`, or
    its DOM property `prop` (`href` resolved to a whole URL, as a click follows it); with
    `visible`, only the displayed ones. Read in one script call: the page re-renders lists and the
    chart on every event, so finding an element and then reading it can meet a detached node
    (Selenium's StaleElementReferenceException, which failed CI once)."""
    return driver.execute_script(
        """const [css, attr, prop, visible] = arguments;
        return Array.from(document.querySelectorAll(css))
          .filter(e => !visible || e.getClientRects().length > 0)
          .map(e => attr ? e.getAttribute(attr) : prop ? e[prop] : e.innerText);""",
        css,
        attr,
        prop,
        visible,
    )


def fresh_postgres(server_url: str, name: str) -> str:
    """The URL of a new, empty database `name` on the Postgres server of `server_url` (the
    `postgres` fixture's): a test's own, so what it keeps reaches no other test."""
    admin = create_engine(database_url(server_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return server_url.rsplit("/", 1)[0] + "/" + name


def database_bytes(url: str) -> bytes:
    """Every byte of a job database: the SQLite files as they are on disk (database, WAL, shared
    memory; the WAL holds the latest writes), read by another process (closing a file this process
    opened drops every POSIX lock the process holds on it, the test's own SQLite connection's
    included), or Postgres's `pg_dump` of the database (every table's rows)."""
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        files = [str(p) for p in path.parent.glob(path.name + "*") if p.is_file()]
        return subprocess.run(["cat", *files], capture_output=True, check=True, timeout=60).stdout
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_dump")) or [shutil.which("pg_dump")]
    r = subprocess.run([found[-1], "--dbname", url], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The service on loopback; `restart()` ends it and starts a new one on the same database."""

    def __init__(self, db: str, home: Path, max_concurrent: int = 1, policy: Policy = TEST_POLICY) -> None:
        self.db, self.home, self.max_concurrent, self.policy = db, home, max_concurrent, policy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        self.svc = JobService(
            self.db,
            self.home,
            self.url,
            max_concurrent=self.max_concurrent,
            poll_s=0.3,
            policy=self.policy,
            public_url=self.url,  # Modal jobs need one; loopback here, as no job leaves this machine
        )
        config = uvicorn.Config(create_app(self.svc), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def restart(self) -> None:
        self.stop()
        self.start()

    def cancel_all(self) -> None:
        for job in self.svc.list():
            if job.state in ("starting", "running", "stopping"):
                self.svc.cancel(job.id)


def client(server, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


def read_events(c: httpx.Client, job_id: str, until, *, last_id: str | None = None, timeout: float = 180) -> list:
    """(id, event, data) of the job's SSE stream until `until(event, data)` is true."""
    out: list = []
    headers = {"Last-Event-ID": last_id} if last_id else {}
    deadline = time.monotonic() + timeout
    with c.stream("GET", f"/api/jobs/{job_id}/events", headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        eid = kind = None
        for line in resp.iter_lines():
            if line.startswith("id:"):
                eid = line[3:].strip()
            elif line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:].strip())
                out.append((eid, kind, data))
                if until(kind, data):
                    return out
            if time.monotonic() > deadline:
                raise AssertionError(f"no end of stream after {timeout} s: {out[-5:]}")
    return out


def wait_serving(proc: subprocess.Popen, url: str, timeout: float = 90) -> None:
    """Until the `scaletune serve` process `proc` answers /healthz at `url`; it must not exit first
    (its stderr, when piped, is in the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
            raise AssertionError(f"the service did not start (exit {proc.poll()}): {err}")
        try:
            httpx.get(url + "/healthz", timeout=2)
            return
        except httpx.TransportError:
            time.sleep(0.3)


def wait_state(c: httpx.Client, job_id: str, states: set[str], timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"/api/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        time.sleep(0.3)
    logs = c.get(f"/api/jobs/{job_id}/logs").text[-3000:]
    raise AssertionError(f"job {job_id} is {job['state']}, not {states}, after {timeout} s\n{logs}")


def plant_job(svc: JobService, run_dir: Path, state: str = "succeeded", token: str = "", **fields) -> str:
    """A job record written straight into the service's database, with its job folder (no run):
    for tests of what the API serves from a job's files. `token`: its report token."""
    import uuid

    from scaletune.serve.edge.auth import digest
    from scaletune.serve.jobs.db import Job

    job_id = uuid.uuid4().hex[:12]
    job_dir = svc.home / job_id
    job_dir.mkdir(parents=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"target": "local", "config_yaml": "", "job_dir": str(job_dir), "run_dir": str(run_dir)}
    with svc.Session() as s:
        s.add(
            Job(
                id=job_id, name=run_dir.name, state=state, token_hash=digest(token) if token else "", **record, **fields
            )
        )
        s.commit()
    return job_id


PREFIX = "/team/st"  # where nginx serves the service (test_mount.py, test_deploy_kit.py)
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
# The password of the Postgres the `postgres` fixture starts: no output may ever show it.
PASSWORD = "s3cret-Pg"

_NGINX_CONF = """worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi;
  uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  server {{
    listen 127.0.0.1:{port};
    location {prefix}/ {{
      proxy_pass http://127.0.0.1:{upstream}/;  # the trailing slash strips the prefix
      proxy_set_header Host $http_host;         # the service checks the Origin against it
      proxy_http_version 1.1;
      proxy_read_timeout 1h;                    # the event stream stays open
    }}
  }}
}}
"""


class Proxy:
    """nginx serving 127.0.0.1:UPSTREAM at http://127.0.0.1:PORT/team/st/ (its own prefix, stripped)."""

    def __init__(self, root: Path, upstream: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{PREFIX}"
        conf = root / "nginx.conf"
        conf.write_text(_NGINX_CONF.format(d=root, port=self.port, upstream=upstream, prefix=PREFIX))
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(root), "-c", str(conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/", timeout=2).status_code >= 400  # not ours
            except httpx.TransportError:
                assert self.proc.poll() is None, (root / "error.log").read_text()
                return False

        try:
            wait_for(up, 20, "nginx")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


# -- task records (tests/serve/test_durable_records.py, test_db.py) ------------------------------
def eval_ready_job(svc: JobService, root: Path, owner: str) -> str:
    """A succeeded job whose `final/` holds no model (`scaletune eval` on it fails in about a
    second), and a data file to evaluate it on (`root`/data.jsonl, one Alpaca record: the service
    checks the file before the task starts)."""
    run = root / f"run-{len(list(root.glob('run-*')))}"
    job_id = plant_job(svc, run, owner=owner)
    (run / "final").mkdir()
    (root / "data.jsonl").write_text('{"instruction": "Say hi.", "input": "", "output": "Hi."}\n')
    return job_id


def task_record(Session, task_id: str):  # noqa: N803 - a sessionmaker
    """The task's row in the job database (`db.TaskRecord`)."""
    from scaletune.serve.jobs.db import TaskRecord

    with Session() as s:
        return s.get(TaskRecord, task_id)


def held_eval_task(c: httpx.Client, job_id: str, Session, data: Path) -> tuple[dict, int]:  # noqa: N803
    """An eval task started through the API and its process stopped (SIGSTOP), so it is still
    running whenever the service stops: (the task as the API answered, its PID). `release` it."""
    import signal

    r = c.post(f"/api/jobs/{job_id}/tasks/eval", json={"data": str(data)})
    assert r.status_code == 202, r.text
    pid = task_record(Session, r.json()["id"]).pid
    os.kill(pid, signal.SIGSTOP)
    return r.json(), pid


def release(pid: int) -> None:
    """End a process `held_eval_task` stopped (whatever signal it has pending)."""
    import signal

    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def tasks_of(c: httpx.Client, job_id: str) -> list[dict]:
    """`GET /api/jobs/ID/tasks`."""
    r = c.get(f"/api/jobs/{job_id}/tasks")
    assert r.status_code == 200, r.text
    return r.json()

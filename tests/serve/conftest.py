"""The serve tier's fixtures: a real `scaletune serve` (uvicorn in a thread, SQLite in tmp), a
headless Chromium logged in to it, and a real Postgres. What the tests import (the service, its
client and SSE reader, the browser, nginx) is in tests/serve/serve_helpers.py, never here."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from scaletune.serve.edge.auth import create_token
from tests.helpers import wait_for
from tests.serve.serve_helpers import PASSWORD, Server, free_port, headless_chromium


@pytest.fixture(scope="module")
def server(module_tmp_path):
    root = module_tmp_path / "serve"
    root.mkdir()
    db = f"sqlite:///{root / 'serve.db'}"
    srv = Server(db, root / "jobs")
    srv.admin = create_token(srv.svc.Session, "admin")
    srv.read = create_token(srv.svc.Session, "read")
    srv.submit = create_token(srv.svc.Session, "submit")
    yield srv
    srv.cancel_all()
    srv.stop()


@pytest.fixture(scope="module")
def page(server, module_tmp_path):
    """A Chromium logged in to `server` with its submit token, the one the tests submit jobs with
    through the API (a job's owner may stop it; module-wide: starting Chromium costs seconds)."""
    from selenium.webdriver.common.by import By

    driver = headless_chromium(module_tmp_path / "chromium-profile")
    try:
        driver.get(server.url + "/login")
        driver.find_element(By.ID, "token").send_keys(server.submit)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.find_elements(By.ID, "config"), 30, "the submit form")
        yield driver
    finally:
        driver.quit()


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _skip_outside_ci(reason: str) -> None:
    """Skip, saying why; under CI=true fail instead (.ci/run installs Postgres: CI must run these)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and no Postgres to test on: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def postgres():
    """A Postgres server on 127.0.0.1 (password auth) in a temporary folder; its URL."""
    pg_bin = _pg_bin()
    if pg_bin is None:
        _skip_outside_ci(
            "NO POSTGRES SERVER HERE: Debian's postgresql package (initdb, pg_ctl) is not installed, "
            "so the job database is not tested on Postgres (apt-get install postgresql)"
        )
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _skip_outside_ci("NO POSTGRES DRIVER: psycopg is not installed (pip install -e '.[serve]')")
    root = Path(tempfile.mkdtemp(prefix="scaletune-pg-"))
    # initdb refuses to run as root: the server then runs as Debian's postgres user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(root, "postgres")
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if as_user:
        shutil.chown(pwfile, "postgres")
    port = free_port()

    def pg(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)

    r = pg(str(pg_bin / "initdb"), "-D", str(root / "data"), "-U", "scaletune", "--auth=scram-sha-256",
           f"--pwfile={pwfile}")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    start = [str(pg_bin / "pg_ctl"), "-D", str(root / "data"), "-o", opts, "-l", str(root / "log"), "-w"]
    r = pg(*start, "start")
    assert r.returncode == 0, r.stdout + r.stderr + (root / "log").read_text()
    server = {"url": f"postgres://scaletune:{PASSWORD}@127.0.0.1:{port}/postgres", "pg": pg, "start": start}
    yield server
    pg(*start[:3], "-m", "immediate", "stop")
    shutil.rmtree(root, ignore_errors=True)

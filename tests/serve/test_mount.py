"""The service under a sub-path (issue 22, item 8: `--root-path`), behind a real nginx that serves
it at /team/st/ and strips the prefix, as a team's shared host does: everything outside the prefix
is nginx's 404, so a link, form, fetch, EventSource or redirect that leaves the prefix fails.

- The page in headless Chromium through the proxy: redirected to the login under the prefix, log
  in, a plan preview and a submit (fetch), the job page, its events streamed in (EventSource,
  unbuffered through nginx) while the run waits on the test, then the artifact link downloading
  the run's own metrics.jsonl. The job is a stand-in for `python -m scaletune train` run by the
  real dispatcher (as in test_watch.py: a tiny real run costs 45 s here); it reports to uvicorn
  directly, not through the proxy, as local jobs do.
- The real `scaletune serve --root-path /team/st` (a subprocess) behind the same proxy: the login
  form, the cookie scoped to the prefix, /healthz, and /docs, whose Swagger UI loads only
  same-origin files that answer 200, and /openapi.json naming the prefix as its server.

Without nginx (Debian's nginx-light) the tests skip, and fail under CI=true."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import httpx
import uvicorn
import yaml

from scaletune.serve.app import create_app
from scaletune.serve.edge.auth import create_token
from scaletune.serve.jobs.service import JobService
from tests.helpers import make_config, subprocess_env, wait_for
from tests.serve.serve_helpers import NGINX, PREFIX, Proxy, Server, dom, free_port, headless_chromium, need

# A URL from the host's root to one of the service's own routes: under a prefix it misses the
# service (nginx answers 404). The old templates held many (href="/jobs/..", fetch('/api/..')).
ABSOLUTE = re.compile(
    rf"""(?:href|src|action)\s*=\s*["']/(?!/|{PREFIX[1:]}/)|["'`]/(?:api|static|jobs|login|compare|docs)\b"""
)

# The stand-in run: one step, then it waits for the test's go-ahead (the page must show the
# stream while the job runs), a second step, a checkpoint, final/.
_STUB = """#!{python}
import json, sys, time
from pathlib import Path
from scaletune.report import Reporter, event_line

run_dir = Path(json.loads(sys.argv[-1].split("=", 1)[1]))  # the service's last override: output_dir=
reporter = Reporter()

def report(kind, **data):
    print(event_line(kind, data), flush=True)
    reporter.add(kind, data, flush=True)

def step(n):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({{"step": n, "loss": 2.0 / n, "stage": "main"}}) + "\\n")

run_dir.mkdir(parents=True, exist_ok=True)
report("phase", phase="training", stage="main")
step(1)
gate = Path({gate!r})
while not gate.exists():
    time.sleep(0.1)
step(2)
(run_dir / "checkpoints" / "step-2").mkdir(parents=True)
report("saved checkpoint", step=2, path=str(run_dir / "checkpoints" / "step-2"))
report("phase", phase="exporting")
(run_dir / "final").mkdir()
"""


def absolute_urls(html: str) -> list[str]:
    return [html[max(0, m.start() - 30) : m.end() + 20] for m in ABSOLUTE.finditer(html)]


class MountedServer(Server):
    """serve_helpers' Server with uvicorn's root_path, as `scaletune serve --root-path` runs it."""

    def start(self) -> None:
        self.svc = JobService(self.db, self.home, self.url, poll_s=0.3, policy=self.policy)
        config = uvicorn.Config(
            create_app(self.svc), host="127.0.0.1", port=self.port, log_level="warning", root_path=PREFIX
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn")


def test_the_page_under_a_prefix_behind_nginx(tiny_model_dir, tmp_path):
    need(NGINX, "needs nginx (apt-get install nginx-light)")
    from selenium.webdriver.common.by import By

    srv = MountedServer(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    gate = tmp_path / "go"
    stub = tmp_path / "stub"
    stub.write_text(_STUB.format(python=sys.executable, gate=str(gate)))
    stub.chmod(0o755)
    srv.svc.dispatchers["local"].python = str(stub)
    token = create_token(srv.svc.Session, "submit")
    proxy = Proxy(tmp_path / "nginx", srv.port)
    driver = headless_chromium(tmp_path / "profile")
    try:
        driver.get(proxy.url + "/")
        assert driver.current_url == proxy.url + "/login", driver.current_url  # the redirect kept the prefix
        assert not absolute_urls(driver.page_source), absolute_urls(driver.page_source)
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "login").click()  # the form posts under the prefix
        wait_for(lambda: driver.find_elements(By.ID, "config"), 30, "the submit form")
        assert driver.current_url == proxy.url + "/"
        assert not absolute_urls(driver.page_source), absolute_urls(driver.page_source)

        run = tmp_path / "run"
        cfg = yaml.safe_dump(make_config(tiny_model_dir, run, training={"max_steps": 2}))
        driver.execute_script("document.getElementById('config').value = arguments[0]", cfg)
        driver.find_element(By.ID, "preview").click()
        wait_for(lambda: "strategy" in "".join(dom(driver, "#plan")), 60, "the plan preview")
        driver.find_element(By.ID, "submit").click()
        wait_for(lambda: "/jobs/" in driver.current_url, 60, "the job page")
        assert driver.current_url.startswith(proxy.url + "/jobs/"), driver.current_url
        job_id = driver.current_url.rsplit("/", 1)[1]
        assert not absolute_urls(driver.page_source), absolute_urls(driver.page_source)

        def points() -> int:
            counts = dom(driver, "#chart polyline", "data-points")
            return int(counts[0]) if counts else 0

        # Streamed while the run waits on the gate: the first step and the state.
        wait_for(lambda: points() == 1, 60, "the first step streamed in")
        wait_for(lambda: dom(driver, "#state") == ["running"], 30, "running")
        gate.touch()
        wait_for(lambda: dom(driver, "#state") == ["succeeded"], 60, "succeeded")
        wait_for(lambda: points() == 2, 15, "the second step")
        wait_for(lambda: dom(driver, "#final", visible=True), 15, "the final/ link")
        assert "[scaletune] phase" in "".join(dom(driver, "#logs"))  # log events too

        ckpt = dom(driver, "#checkpoints a", prop="href")[0]
        assert ckpt == f"{proxy.url}/api/jobs/{job_id}/artifacts/checkpoints/step-2", ckpt
        link = driver.execute_script(
            "return Array.from(document.links).find(a => a.textContent === 'metrics.jsonl')?.href"
        )
        assert link == f"{proxy.url}/api/jobs/{job_id}/artifacts/metrics.jsonl", link
        cookies = {c["name"]: c["value"] for c in driver.get_cookies()}
        got = httpx.get(link, cookies=cookies, timeout=30)  # as the browser's click would fetch it
        assert got.status_code == 200 and got.headers["content-disposition"].startswith("attachment"), got.text
        assert got.content == (run / "metrics.jsonl").read_bytes()
        assert httpx.get(ckpt, cookies=cookies, timeout=30).json() == []  # an empty folder: listed
        # Log out under the prefix: the cookie set on /team/st/ is the one deleted.
        driver.find_element(By.ID, "logout").click()
        wait_for(lambda: driver.current_url == proxy.url + "/login", 30, "the login page under the prefix")
        assert not [c for c in driver.get_cookies() if c["name"] == "scaletune_session"]
        driver.get(proxy.url + "/")
        assert driver.current_url == proxy.url + "/login", driver.current_url
    finally:
        driver.quit()
        proxy.close()
        srv.cancel_all()
        srv.stop()


def test_old_templates_fail_the_absolute_url_check():
    """The check's control: what the page held before --root-path (from the old templates)."""
    for old in ('<h1><a href="/">scaletune serve</a></h1>', "const es=new EventSource('/api/jobs/'+ID+'/events');"):
        assert absolute_urls(old), old
    assert not absolute_urls(f"<a href=\"{PREFIX}/jobs/x\"></a> BASE+'api/jobs/'")


def test_the_cli_with_root_path_behind_nginx(tmp_path):
    need(NGINX, "needs nginx (apt-get install nginx-light)")
    port = free_port()
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    env = subprocess_env()
    token = subprocess.run(
        [sys.executable, "-m", "scaletune", "serve", "token", "create", "--scope", "read", "--db", db],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.split()[-1]
    log = tmp_path / "serve.log"
    args = ["serve", "--port", str(port), "--db", db, "--jobs-dir", str(tmp_path / "jobs"), "--root-path", PREFIX]
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "scaletune", *args], stdout=out, stderr=out, env=env)
    proxy = None
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 60, "scaletune serve")
        assert f"under {PREFIX}/" in log.read_text()
        proxy = Proxy(tmp_path / "nginx", port)
        with httpx.Client(timeout=30) as c:
            r = c.get(proxy.url + "/")
            assert (r.status_code, r.headers["location"]) == (303, f"{PREFIX}/login")
            page = c.get(proxy.url + "/login").text
            assert f'action="{PREFIX}/login"' in page and not absolute_urls(page), absolute_urls(page)
            r = c.post(
                proxy.url + "/login", data={"token": token}, headers={"Origin": f"http://127.0.0.1:{proxy.port}"}
            )
            assert (r.status_code, r.headers["location"]) == (303, f"{PREFIX}/"), r.text
            assert f"Path={PREFIX}/" in r.headers["set-cookie"], r.headers["set-cookie"]
            assert c.get(proxy.url + "/healthz").json() == {"status": "ok"}
            # /docs by the session cookie, as a browser opens it: every file it loads is under the
            # prefix on this origin and answers 200.
            docs = c.get(proxy.url + "/docs")
            assert docs.status_code == 200, docs.text
            refs = re.findall(r"""(?:src|href)=["']([^"']+)|url:\s*'([^']+)'""", docs.text)
            urls = [a or b for a, b in refs]
            assert len(urls) == 4, urls  # the script, the style, the icon, the schema
            for url in urls:
                assert url.startswith(f"{PREFIX}/"), url
                got = c.get(f"http://127.0.0.1:{proxy.port}{url}")
                assert got.status_code == 200, (url, got.status_code)
            assert "swagger-ui.css" in docs.text and "cdn" not in docs.text
            schema = c.get(proxy.url + "/openapi.json").json()
            assert schema["servers"] == [{"url": PREFIX}]
    finally:
        if proxy:
            proxy.close()
        proc.terminate()
        proc.wait(timeout=30)

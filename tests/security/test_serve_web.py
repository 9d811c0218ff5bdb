"""The service's edge and page (issue 21, item 2): DNS rebinding against the token-less mode, the
Origin of unsafe requests (login CSRF in a real Chromium), reflected script in /compare (a real
Chromium), nosniff / CSP / attachments, and /docs closed once tokens exist."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest

from scaletune.serve.edge.auth import create_token
from tests.serve.serve_helpers import Server, client, free_port, headless_chromium, plant_job


def test_dns_rebinding_and_foreign_origin_refused_without_tokens(tmp_path):
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    try:
        c = client(srv, None)
        assert c.get("/api/jobs").status_code == 200  # loopback, no token: the documented open mode
        evil = {"Host": f"attacker.example:{srv.port}"}
        assert c.get("/api/jobs", headers=evil).status_code == 400
        r = c.post("/api/jobs", headers=evil, json={"config": "x: 1", "dry_run": True})
        assert r.status_code == 400, r.text
        # The right Host but a page of another origin (its script posting to 127.0.0.1).
        r = c.post("/api/jobs", headers={"Origin": "http://attacker.example"}, json={"config": "x: 1"})
        assert r.status_code == 403, r.text
        r = c.post("/api/jobs", headers={"Origin": "null"}, json={"config": "x: 1"})
        assert r.status_code == 403, r.text
    finally:
        srv.stop()


def _attacker_site(html: str) -> tuple[http.server.HTTPServer, str]:
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    port = free_port()
    site = http.server.HTTPServer(("127.0.0.1", port), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    return site, f"http://127.0.0.1:{port}/"


def test_login_csrf_from_another_site_in_chromium(tmp_path):
    """Another site's page posts a login form with the attacker's token: the visitor stays logged out."""
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    attacker = create_token(srv.svc.Session, "read")
    site, page = _attacker_site(
        f'<form id="f" method="post" action="{srv.url}/login"><input name="token" value="{attacker}"></form>'
        "<script>document.getElementById('f').submit()</script>"
    )
    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        driver.get(page)
        time.sleep(3)
        driver.get(srv.url + "/")
        assert driver.current_url.endswith("/login"), "a cross-site form logged the visitor in"
    finally:
        driver.quit()
        site.shutdown()
        srv.stop()


def test_reflected_script_in_compare_runs_nothing_in_chromium(tmp_path):
    """A link to /compare with markup in `a` (its fetch pointed at a real job's metrics, so the
    chart draws it): no script of it runs; a real comparison still draws both series."""
    from selenium.webdriver.common.by import By

    from scaletune.serve.jobs.db import Metric

    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    victim = create_token(srv.svc.Session, "read")
    job = plant_job(srv.svc, tmp_path / "run")
    with srv.svc.Session() as s:
        s.add_all(
            [
                Metric(job_id=job, step=i, kind="train", loss=1.0 / i, data={"step": i, "loss": 1.0 / i})
                for i in (1, 2, 3)
            ]
        )
        s.commit()
    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        driver.get(srv.url + "/login")
        driver.find_element(By.ID, "token").send_keys(victim)
        driver.find_element(By.ID, "login").click()
        time.sleep(1)
        payload = f"{job}/metrics?x=<img src=x onerror=\"document.title='pwned'\">"
        driver.get(f"{srv.url}/compare?" + str(httpx.QueryParams({"a": payload, "b": job})))
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            assert driver.title != "pwned", "the page ran script from the URL"
            time.sleep(0.3)
        driver.get(f"{srv.url}/compare?a={job}&b={job}")
        time.sleep(2)
        drawn = driver.find_elements(By.CSS_SELECTOR, "#chart polyline")
        assert len(drawn) == 2, (driver.current_url, driver.page_source[:2000])
    finally:
        driver.quit()
        srv.stop()


def test_headers_attachments_and_docs(tmp_path):
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    try:
        (tmp_path / "run" / "final").mkdir(parents=True)
        (tmp_path / "run" / "final" / "page.html").write_text("<script>alert(1)</script>")
        job = plant_job(srv.svc, tmp_path / "run")
        read = create_token(srv.svc.Session, "read")
        anon, c = client(srv, None), client(srv, read)
        for path in ("/docs", "/openapi.json"):
            assert anon.get(path).status_code == 401, path
            assert c.get(path).status_code == 200, path
        r = c.get(f"/api/jobs/{job}/artifacts/final/page.html")
        assert r.status_code == 200 and r.headers["content-disposition"].startswith("attachment")
        assert r.headers["x-content-type-options"] == "nosniff"
        page = anon.get("/login")
        assert page.headers["x-content-type-options"] == "nosniff"
        assert "script-src 'nonce-" in page.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    finally:
        srv.stop()


@pytest.mark.parametrize("origin", ["http://attacker.example", "null"])
def test_login_refuses_a_foreign_origin(tmp_path, origin):
    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    try:
        token = create_token(srv.svc.Session, "read")
        r = client(srv, None).post("/login", data={"token": token}, headers={"Origin": origin}, follow_redirects=False)
        assert r.status_code == 403 and "set-cookie" not in r.headers, r.headers
        r = client(srv, None).post("/login", data={"token": token}, headers={"Origin": srv.url}, follow_redirects=False)
        assert r.status_code == 303 and "set-cookie" in r.headers
    finally:
        srv.stop()

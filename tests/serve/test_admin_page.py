"""The admin page and its API (issue 39, item 9): tokens made by an admin work for their scope, are
answered once and stored only hashed (the database's bytes searched: the SQLite files read by another
process, or `pg_dump`), are never listed with their value and fail once revoked (401); every admin
route and the page refuse read and submit tokens (403) and their pages offer no link to it; the
audit's filters and paging are applied by the service. The API tests run against a real service on
SQLite and on the real Postgres (conftest's `postgres`); one Chromium test walks the page: create,
the value shown once, copy, revoke after the confirmation, the audit filtered by action."""

from __future__ import annotations

import datetime as dt
import inspect
import uuid

import pytest
from fastapi.routing import APIRoute

from scaletune.serve.app import ROUTERS
from scaletune.serve.edge.auth import ENV_ADMIN, create_token, digest, install_env_admin
from scaletune.serve.jobs.db import Audit
from tests.helpers import wait_for
from tests.serve.serve_helpers import Server, client, database_bytes, dom, fresh_postgres, headless_chromium

ENV_VALUE = "env-admin-" + uuid.uuid4().hex + uuid.uuid4().hex  # SCALETUNE_ADMIN_TOKEN's value
BASE = dt.datetime(2031, 3, 4, 5, 0, 0)  # the planted audit rows' first time: after any real row


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def team(request, module_tmp_path):
    """A service on a fresh database; tokens: admin `ops`, submit `alice`, read `carol`, and the
    configured admin token SCALETUNE_ADMIN_TOKEN installs (`admin-env`)."""
    root = module_tmp_path / request.param
    root.mkdir()
    if request.param == "sqlite":
        url = f"sqlite:///{root / 'serve.db'}"
    else:
        url = fresh_postgres(request.getfixturevalue("postgres")["url"], "admin_page")
    srv = Server(url, root / "jobs")
    people = (("ops", "admin"), ("alice", "submit"), ("carol", "read"))
    srv.tokens = {name: create_token(srv.svc.Session, scope, name=name) for name, scope in people}
    assert install_env_admin(srv.svc.Session, ENV_VALUE) == []
    yield srv
    srv.stop()
    srv.svc.engine.dispose()


def test_a_token_made_by_an_admin_works_for_its_scope_is_answered_once_and_stored_hashed(team):
    made = {}
    with client(team, team.tokens["ops"]) as ops:
        for name, scope in (("dana", "read"), ("erin", "submit"), ("fay", "admin")):
            r = ops.post("/api/tokens", json={"name": name, "scope": scope})
            assert r.status_code == 201, r.text
            assert r.headers["cache-control"] == "no-store"  # no cache on the way keeps the value
            assert r.json()["created_by"] == "ops" and r.json()["configured"] is False
            made[name] = r.json()["token"]
        for name, value in made.items():
            scope = {"dana": "read", "erin": "submit", "fay": "admin"}[name]
            with client(team, value) as c:
                assert c.get("/api/whoami").json() == {"name": name, "scope": scope}
                assert c.get("/api/jobs").status_code == 200
                # A submit route: the read token refused before its body is read; the others reach the check.
                assert c.post("/api/jobs", json={}).status_code == (403 if scope == "read" else 422)
                assert c.get("/api/tokens").status_code == (200 if scope == "admin" else 403)
        listings = [ops.get("/api/tokens").text for _ in range(2)]
        audit = ops.get("/api/audit", params={"limit": 10_000}).text
        listed = {t["name"]: t for t in ops.get("/api/tokens").json()}
        reserved = ops.post("/api/tokens", json={"name": ENV_ADMIN, "scope": "read"})
    for text_ in (*listings, audit):
        assert not any(v in text_ for v in made.values())
    assert all("token" not in t for t in listed.values())
    assert {n for n, t in listed.items() if t["configured"]} == {ENV_ADMIN}
    assert reserved.status_code == 422 and "kept for the token SCALETUNE_ADMIN_TOKEN installs" in reserved.text
    stored = database_bytes(team.db)
    for value in (*made.values(), *team.tokens.values(), ENV_VALUE):
        assert value.encode() not in stored
        assert digest(value).encode() in stored  # control: the dump holds the tokens table's hashes


def test_a_revoked_token_fails_and_the_audit_says_who_revoked_it(team):
    with client(team, team.tokens["ops"]) as ops:
        value = ops.post("/api/tokens", json={"name": "gus", "scope": "submit"}).json()["token"]
        with client(team, value) as gus:
            assert gus.get("/api/jobs").status_code == 200
            revoked = ops.delete("/api/tokens/gus")
            assert revoked.status_code == 200 and revoked.json()["revoked"], revoked.text
            assert gus.get("/api/jobs").status_code == 401
            assert gus.get("/api/whoami").status_code == 401
        rows = ops.get("/api/audit", params={"action": "token.revoke", "actor": "ops"}).json()
    assert rows and rows[0]["detail"] == "gus"


def admin_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the app's routers (`app.ROUTERS`, included without a
    prefix) that needs an admin token: found by the `need("admin")` dependency anywhere in its
    dependency tree, not from a list kept by hand."""

    def needs_admin(dependant) -> bool:
        for d in dependant.dependencies:
            call = d.call
            if getattr(call, "__qualname__", "") == "need.<locals>.dep":
                if inspect.getclosurevars(call).nonlocals.get("scope") == "admin":
                    return True
            if needs_admin(d):
                return True
        return False

    return sorted(
        (m, r.path)
        for router in ROUTERS
        for r in router.routes
        if isinstance(r, APIRoute) and needs_admin(r.dependant)
        for m in r.methods
    )


def test_read_and_submit_tokens_get_403_on_every_admin_route_and_no_link(team):
    routes = admin_routes()
    known = {("GET", "/api/tokens"), ("POST", "/api/tokens"), ("DELETE", "/api/tokens/{name}"), ("GET", "/api/audit"),
             ("GET", "/api/admin/policy"), ("PUT", "/api/admin/policy")}  # fmt: skip
    assert known <= set(routes), routes  # control: the walk finds the admin routes
    for name in ("alice", "carol"):
        with client(team, team.tokens[name]) as c:
            for method, path in routes:
                r = c.request(method, path.replace("{name}", "ops"), json={} if method in ("POST", "PUT") else None)
                assert r.status_code == 403, (name, method, path, r.status_code, r.text)
            page = c.get("/admin")
            assert page.status_code == 403 and "needs an admin token" in page.text
            assert 'id="whoami"' in c.get("/").text and 'id="admin-link"' not in c.get("/").text
    with client(team, team.tokens["ops"]) as ops:
        assert ops.get("/admin").status_code == 200 and 'id="admin-link"' in ops.get("/").text
        assert all(ops.get(p).status_code == 200 for m, p in routes if m == "GET")
    with client(team, "st_not-a-token") as stranger:
        assert stranger.get("/admin").headers["location"].endswith("/login")  # 303 to the login page


def plant_audit(srv) -> list[dict]:
    """24 audit rows, a minute apart from BASE, by two actors, of three actions, on two jobs and
    none; returned as the API words them."""
    rows = []
    with srv.svc.Session() as s:
        for i in range(24):
            a = Audit(
                at=BASE + dt.timedelta(minutes=i),
                actor=("auditor-a", "auditor-b")[i % 2],
                action=("job.stop", "token.create", "data.delete")[i % 3],
                job_id=("aud1", "aud2", None, "aud1")[i % 4],
                detail=f"row {i}",
            )
            s.add(a)
            s.flush()
            rows.append(a)
        s.commit()
        return [a.public() for a in rows]


def test_the_audit_is_filtered_and_paged_by_the_service(team):
    planted = plant_audit(team)
    newest_first = sorted(planted, key=lambda a: -a["id"])
    at = lambda a: dt.datetime.fromisoformat(a["at"].removesuffix("Z"))  # noqa: E731
    since = BASE.isoformat()  # every query from BASE on: only the planted rows (the others are older)
    cases = {
        (("actor", "auditor-a"),): lambda a: a["actor"] == "auditor-a",
        (("action", "job.stop"),): lambda a: a["action"] == "job.stop",
        (("job_id", "aud1"),): lambda a: a["job_id"] == "aud1",
        (("since", (BASE + dt.timedelta(minutes=5)).isoformat()), ("until", (BASE + dt.timedelta(minutes=11)).isoformat())):
            lambda a: BASE + dt.timedelta(minutes=5) <= at(a) < BASE + dt.timedelta(minutes=11),
        # The same window with a zone: 07:05+02:00 is 05:05 UTC.
        (("since", (BASE + dt.timedelta(hours=2, minutes=5)).isoformat() + "+02:00"), ("until", (BASE + dt.timedelta(minutes=11)).isoformat() + "Z")):
            lambda a: BASE + dt.timedelta(minutes=5) <= at(a) < BASE + dt.timedelta(minutes=11),
        (("actor", "auditor-b"), ("action", "token.create"), ("job_id", "aud2"), ("until", (BASE + dt.timedelta(minutes=20)).isoformat())):
            lambda a: (a["actor"], a["action"], a["job_id"]) == ("auditor-b", "token.create", "aud2") and at(a) < BASE + dt.timedelta(minutes=20),
    }  # fmt: skip
    with client(team, team.tokens["ops"]) as ops:
        for query, keep in cases.items():
            params = dict(query)
            params.setdefault("since", since)
            got = ops.get("/api/audit", params=params)
            assert got.status_code == 200, got.text
            want = [a for a in newest_first if keep(a)]
            assert want and got.json() == want, (query, [a["id"] for a in got.json()], [a["id"] for a in want])
        pages = [
            ops.get("/api/audit", params={"since": since, "limit": 5, "offset": o}).json() for o in range(0, 30, 5)
        ]
        assert [len(p) for p in pages] == [5, 5, 5, 5, 4, 0]
        assert [a for p in pages for a in p] == newest_first
        for bad in ({"since": "yesterday"}, {"limit": 0}, {"offset": -1}):
            r = ops.get("/api/audit", params=bad)
            assert r.status_code == 422 and {"detail", "problems"} == set(r.json()), (bad, r.text)
            assert next(iter(bad)) in r.json()["problems"][0]


def test_the_page_makes_a_token_shows_it_once_revokes_it_after_asking_and_filters_the_audit(server, module_tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    install_env_admin(server.svc.Session, ENV_VALUE)  # a configured token: listed, no Revoke
    with client(server, server.admin) as admin:
        admin_name = admin.get("/api/whoami").json()["name"]
    driver = headless_chromium(module_tmp_path / "admin-profile")
    try:
        driver.get(server.url + "/login")
        driver.find_element(By.ID, "token").send_keys(server.admin)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: dom(driver, "#whoami") == [admin_name], 30, "signed in as the admin")
        driver.find_element(By.ID, "admin-link").click()
        wait_for(
            lambda: driver.current_url.endswith("/admin") and dom(driver, "#tokens tbody tr"), 30, "the token list"
        )
        env_row = dom(driver, f'#tokens tr[data-name="{ENV_ADMIN}"]')
        assert "configured" in env_row[0] and "not revocable here" in env_row[0]
        assert not driver.find_elements(By.CSS_SELECTOR, f'#tokens tr[data-name="{ENV_ADMIN}"] button')

        driver.find_element(By.ID, "token-name").send_keys("frank")
        Select(driver.find_element(By.ID, "token-scope")).select_by_visible_text("read")
        driver.find_element(By.ID, "token-create").click()
        wait_for(lambda: driver.find_element(By.ID, "token-value").get_attribute("value"), 30, "the new value")
        value = driver.find_element(By.ID, "token-value").get_attribute("value")
        assert dom(driver, "#token-made-name") == ["frank"] and dom(driver, "#token-made", visible=True)
        with client(server, value) as frank:
            assert frank.get("/api/whoami").json() == {"name": "frank", "scope": "read"}
        wait_for(lambda: dom(driver, '#tokens tr[data-name="frank"]'), 30, "frank listed")
        assert value not in " ".join(dom(driver, "#tokens tr")) + " ".join(dom(driver, "#audit tr"))
        driver.execute_cdp_cmd(
            "Browser.grantPermissions",
            {"origin": server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
        )
        driver.find_element(By.ID, "token-copy").click()
        wait_for(lambda: dom(driver, "#token-copied") == ["copied"], 10, "copied")
        assert (
            driver.execute_async_script(
                "navigator.clipboard.readText().then(arguments[0], e => arguments[0](String(e)))"
            )
            == value
        )
        driver.refresh()  # the value is gone for good
        wait_for(lambda: dom(driver, '#tokens tr[data-name="frank"]'), 30, "the token list again")
        assert value not in driver.page_source and not dom(driver, "#token-made", visible=True)

        def revoke_button():
            return driver.find_element(By.CSS_SELECTOR, '#tokens tr[data-name="frank"] .token-revoke')

        revoke_button().click()
        assert dom(driver, '#tokens tr[data-name="frank"] .confirm button') == ["Yes, revoke", "No, keep it"]
        driver.find_element(By.CSS_SELECTOR, ".token-revoke-no").click()
        assert not dom(driver, ".confirm")
        with client(server, value) as frank:
            assert frank.get("/api/whoami").status_code == 200  # "No" changed nothing
        revoke_button().click()
        driver.find_element(By.CSS_SELECTOR, ".token-revoke-yes").click()
        wait_for(lambda: "revoked" in dom(driver, '#tokens tr[data-name="frank"] td.status')[0], 30, "frank revoked")
        assert not driver.find_elements(By.CSS_SELECTOR, '#tokens tr[data-name="frank"] button')
        with client(server, value) as frank:
            assert frank.get("/api/whoami").status_code == 401

        driver.refresh()  # the action list now holds token.revoke
        wait_for(lambda: dom(driver, "#audit tbody tr"), 30, "the audit rows")
        Select(driver.find_element(By.ID, "audit-action")).select_by_visible_text("token.revoke")
        driver.find_element(By.ID, "audit-filter").click()
        with client(server, server.admin) as admin:
            want = [str(a["id"]) for a in admin.get("/api/audit", params={"action": "token.revoke"}).json()]
        assert want
        wait_for(lambda: dom(driver, "#audit tbody tr", "data-id") == want, 30, "only the token.revoke rows")
        assert set(dom(driver, "#audit tbody tr", "data-action")) == {"token.revoke"}
        assert dom(driver, "#audit tbody tr td:nth-child(5)")[0] == "frank"
    finally:
        driver.quit()

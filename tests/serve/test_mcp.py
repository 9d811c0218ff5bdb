"""The service's MCP endpoint (`/mcp`, serve/api/mcp_server.py) through the MCP SDK's own client
(`mcp.Client` over streamable HTTP) against the real service on loopback (tokens in use): a
submit token submits a tiny real training job, watches it to the end and reads its metrics,
compared with the run's metrics.jsonl (the control) and the REST API's answers; a config with
three problems comes back as one refusal naming each, as the REST API names them; a read token
lists and reads but is refused submit and stop; another submit token may not stop the owner's
job, the owner may; no token and a page's session cookie alone act as nobody."""

from __future__ import annotations

import asyncio
import json

import httpx
import httpx2
import pytest
import yaml

from tests.helpers import make_config
from tests.serve.serve_helpers import client, wait_state

mcp = pytest.importorskip("mcp", reason="needs the MCP SDK (the serve extra)")
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

TOOLS = {"list_jobs", "get_job", "submit_job", "job_metrics", "watch_job", "stop_job"}
JOB = {"max_steps": 4, "save_every": 0, "micro_batch_size": 8}


def call(server, token: str | None, tool: str | None, args: dict | None = None, *, cookies: dict | None = None):
    """One `tools/call` (or, with `tool` None, `tools/list`) through the SDK's client, as `token`."""

    async def go():
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx2.AsyncClient(headers=headers, cookies=cookies, timeout=300) as http:
            async with mcp.Client(streamable_http_client(server.url + "/mcp", http_client=http)) as c:
                if tool is None:
                    return await c.list_tools()
                return await c.call_tool(tool, args or {})

    return asyncio.run(go())


def text(result) -> str:
    return " ".join(getattr(part, "text", "") for part in result.content)


def data(result):
    """A tool's answer: its structured content (the SDK wraps a list as `{"result": [...]}`)."""
    assert not result.is_error, text(result)
    got = result.structured_content
    return got["result"] if isinstance(got, dict) and set(got) == {"result"} else got


@pytest.fixture(scope="module")
def finished(server, tiny_model_dir, module_tmp_path):
    """A tiny real job submitted and watched to its end through MCP with the submit token."""
    out = module_tmp_path / "mcp-run"
    config = yaml.safe_dump(make_config(tiny_model_dir, out, training=JOB))
    submitted = data(call(server, server.submit, "submit_job", {"config": config}))
    watched = data(call(server, server.submit, "watch_job", {"job_id": submitted["id"], "wait_s": 300}))
    return submitted, watched, out


def test_tools_are_listed_with_their_arguments(server):
    tools = {t.name: t for t in call(server, server.read, None).tools}
    assert set(tools) == TOOLS
    assert set(tools["submit_job"].input_schema["required"]) == {"config"}
    assert "job_id" in tools["stop_job"].input_schema["properties"]
    assert tools["watch_job"].description and "wait_s" in tools["watch_job"].description


def test_a_job_submitted_and_watched_through_mcp_trains_and_reports_its_metrics(server, finished):
    submitted, watched, out = finished
    assert submitted["state"] in ("queued", "checking"), submitted
    assert watched["ended"] is True and watched["job"]["state"] == "succeeded", watched
    written = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written if "loss" in r] == [1, 2, 3, 4]
    assert watched["last_metrics"] == written[-1]
    got = data(call(server, server.read, "job_metrics", {"job_id": submitted["id"], "since_step": 2, "last": 1}))
    assert got["lines"] == written[-1:] and got["lines_after_since_step"] == 2
    rest = client(server, server.read)
    assert got["summary"] == rest.get(f"/api/jobs/{submitted['id']}/metrics/summary").json()
    assert (
        data(call(server, server.read, "get_job", {"job_id": submitted["id"]}))
        == rest.get(f"/api/jobs/{submitted['id']}").json()
    )
    listed = data(call(server, server.read, "list_jobs"))
    assert submitted["id"] in [j["id"] for j in listed]
    assert (out / "final" / "config.json").is_file()
    # The audit names the token that submitted through MCP, as for a submission over REST.
    audit = client(server, server.admin).get("/api/audit", params={"job_id": submitted["id"]}).json()
    whoami = client(server, server.submit).get("/api/whoami").json()["name"]
    assert [(r["action"], r["actor"]) for r in audit] == [("job.submit", whoami)], audit


def test_a_bad_config_is_refused_naming_every_problem_as_the_api_does(server, tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "bad", training=JOB)
    cfg["model"]["dtype"] = "float99"
    cfg["training"]["micro_batch_size"] = 0
    args = {"config": yaml.safe_dump(cfg), "overrides": ["training.learning_rate=x"]}
    refused = call(server, server.submit, "submit_job", args)
    assert refused.is_error
    rest = client(server, server.submit).post("/api/jobs", json=args)
    assert rest.status_code == 422
    problems = rest.json()["problems"]
    assert len(problems) >= 3 and all(p in text(refused) for p in problems), (problems, text(refused))
    assert "HTTP 422 invalid config: " in text(refused)
    assert not (tmp_path / "bad").exists()


def test_scopes_and_owners_are_the_apis(server, tiny_model_dir, tmp_path):
    config = yaml.safe_dump(make_config(tiny_model_dir, tmp_path / "long", training={**JOB, "max_steps": 100000}))
    refused = call(server, server.read, "submit_job", {"config": config})
    assert refused.is_error and "HTTP 403" in text(refused) and "submit is needed" in text(refused), text(refused)
    job = data(call(server, server.submit, "submit_job", {"config": config}))
    wait_state(client(server, server.read), job["id"], {"running"})
    # Another submit token is not the job's owner; a read token may not stop at all.
    from scaletune.serve.edge.auth import create_token

    other = create_token(server.svc.Session, "submit", name="mcp-other")
    for token in (other, server.read):
        refused = call(server, token, "stop_job", {"job_id": job["id"]})
        assert refused.is_error and "HTTP 403" in text(refused), text(refused)
    assert client(server, server.read).get(f"/api/jobs/{job['id']}").json()["state"] == "running"
    stopped = data(call(server, server.submit, "stop_job", {"job_id": job["id"]}))
    assert stopped["state"] in ("stopping", "stopped"), stopped
    assert wait_state(client(server, server.read), job["id"], {"stopped"})["state"] == "stopped"
    odd = call(server, server.read, "get_job", {"job_id": "../tokens"})
    assert odd.is_error and "is not a job id" in text(odd)


def test_no_token_and_a_session_cookie_alone_act_as_nobody(server):
    # The guard refuses an unsafe request to /mcp without a live token before reading its body.
    bare = httpx.post(server.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert bare.status_code == 401, bare.text
    # A page's session cookie gets the body read (the page's own routes take it) but is not passed
    # on to the API: a tool called with it alone is refused as a caller without a token.
    login = httpx.post(server.url + "/login", data={"token": server.admin}, follow_redirects=False)
    cookie = login.cookies.get("scaletune_session")
    assert cookie, login.headers
    refused = call(server, None, "list_jobs", cookies={"scaletune_session": cookie})
    assert refused.is_error and "HTTP 401" in text(refused), text(refused)

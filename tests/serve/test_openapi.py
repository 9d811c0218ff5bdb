"""The API's description and its refusals (issue 22, item 8), against the real service: /openapi.json
declares the bearer scheme each token-guarded route needs and types the main answers; /docs loads
Swagger UI from the service itself (no CDN: it works offline); every 422 has one shape, whether
FastAPI cannot read the request or the config's checks refuse it.

The control for each schema is the live answer of the same route: it must fit what is declared."""

from __future__ import annotations

import re

import yaml

from tests.helpers import make_config
from tests.serve.serve_helpers import client, plant_job


def resolve(schema: dict, ref_or_schema: dict) -> dict:
    ref = ref_or_schema.get("$ref", "")
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else ref_or_schema


def test_schema_declares_the_bearer_scheme_and_the_answers(server, tmp_path):
    job_id = plant_job(server.svc, tmp_path / "run")
    with client(server, server.read) as c:
        schema = c.get("/openapi.json").json()
        live = {"/api/jobs": c.get("/api/jobs").json(), "/api/jobs/{job_id}": c.get(f"/api/jobs/{job_id}").json()}
    schemes = schema["components"]["securitySchemes"]
    assert schemes["token"] == {"type": "http", "scheme": "bearer", "description": schemes["token"]["description"]}
    paths = schema["paths"]
    for path, method in [("/api/jobs", "get"), ("/api/jobs", "post"), ("/api/jobs/{job_id}/stop", "post")]:
        assert {"token": []} in paths[path][method]["security"], (path, method)
    assert "security" not in paths["/healthz"]["get"]  # no token needed
    assert {"job token": []} in paths["/api/jobs/{job_id}/report"]["post"]["security"]

    def answer(path: str, method: str, status: str) -> dict:
        return resolve(schema, paths[path][method]["responses"][status]["content"]["application/json"]["schema"])

    summary = resolve(schema, answer("/api/jobs", "get", "200")["items"])
    assert answer("/api/jobs/{job_id}", "get", "200") == summary
    assert set(summary["required"]) >= {"id", "state", "target", "run_dir", "created"}
    assert set(summary["properties"]) == set(live["/api/jobs/{job_id}"])  # every field the API answers
    assert any(j["id"] == job_id for j in live["/api/jobs"])
    assert set(answer("/api/jobs", "post", "201")["properties"]) == {"id", "state", "plan", "replayed"}
    assert answer("/api/jobs", "post", "202") == answer("/api/jobs", "post", "201")  # `checking`: the same shape
    assert set(answer("/healthz", "get", "200")["properties"]) == {"status", "detail"}
    # One refusal shape declared, FastAPI's own (HTTPValidationError) nowhere.
    problems = answer("/api/jobs", "post", "422")
    assert set(problems["properties"]) == {"detail", "problems"}
    assert answer("/api/jobs/{job_id}/stop", "post", "409") == problems
    assert "HTTPValidationError" not in str(schema)


def test_one_422_shape_for_a_bad_request_and_a_bad_config(server, tiny_model_dir, tmp_path):
    bad = make_config(tiny_model_dir, tmp_path / "run")
    bad["model"]["dtype"] = "float99"
    with client(server, server.submit) as c:
        config = c.post("/api/jobs", json={"config": yaml.safe_dump(bad)})  # the checks refuse it
        request = c.post("/api/jobs", json={"config": 5, "overrides": "x", "dry_run": "maybe"})  # unreadable
        broken = c.post("/api/jobs", content=b'{"config": ', headers={"content-type": "application/json"})
    assert (config.status_code, request.status_code, broken.status_code) == (422, 422, 422)
    assert set(config.json()) == set(request.json()) == set(broken.json()) == {"detail", "problems"}
    assert any("model.dtype" in p for p in config.json()["problems"]), config.json()
    lines = request.json()["problems"]  # every field named, by the name the request used
    for field in ("config", "overrides", "dry_run"):
        assert any(line.startswith(f"{field}: ") for line in lines), (field, lines)
    assert "JSON decode error" in broken.json()["problems"][0], broken.json()


def test_docs_load_only_the_services_own_files(server):
    with client(server, server.read) as c:
        docs = c.get("/docs")
        assert docs.status_code == 200, docs.text
        urls = [a or b for a, b in re.findall(r"""(?:src|href)=["']([^"']+)|url:\s*'([^']+)'""", docs.text)]
        assert sorted(urls) == sorted(
            ["/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/docs/assets/favicon.png"]
            + ["/openapi.json"]
        ), urls
        for url in urls:
            assert c.get(url).status_code == 200, url
        bundle = c.get("/docs/assets/swagger-ui-bundle.js")
        assert "SwaggerUIBundle" in bundle.text[:200_000] and len(bundle.content) > 500_000
        # The page's CSP lets in its own files and its one inline script (by nonce), nothing else.
        csp = docs.headers["content-security-policy"]
        nonce = re.search(r"'nonce-([^']+)'", csp).group(1)
        assert f'<script nonce="{nonce}">' in docs.text and "http" not in csp
        assert c.get("/docs/assets/swagger-ui-bundle.js.map").status_code == 404  # the allow-list

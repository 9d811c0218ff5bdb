"""/openapi.json and /docs (Swagger UI), both behind a read token; Swagger UI's script and style are
served from the `fastapi-offline` package's copy of Swagger UI 5 (the serve extra), so /docs works
without internet and its page loads nothing from another origin. Swagger UI 5 reads OpenAPI 3.1,
the version FastAPI writes (4.x answered "Unable to render this definition"). Every URL carries
the mount prefix (--root-path)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse

from scaletune.serve.edge.access import read
from scaletune.serve.edge.guard import NONCE_KEY

# The files /docs loads (the package ships more: sources maps, other bundles, a demo page).
ASSETS = {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}
# Swagger UI sets style attributes and draws data: images; its one inline script runs by nonce.
DOCS_CSP = (
    "default-src 'none'; script-src 'self' 'nonce-{nonce}'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def root_of(request: Request) -> str:
    """The mount prefix (`--root-path`, e.g. `/team/st`), or ""."""
    return request.scope.get("root_path", "").rstrip("/")


router = APIRouter()


@router.get("/openapi.json", include_in_schema=False, dependencies=[read])
def openapi(request: Request):
    schema = dict(request.app.openapi())
    root = root_of(request)
    if root:  # "Try it out" (and any generated client) calls the API under the prefix
        schema["servers"] = [{"url": root}]
    return schema


@router.get("/docs", include_in_schema=False, dependencies=[read])
def docs(request: Request):
    root = root_of(request)
    page = get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title="scaletune serve API",
        swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
        swagger_favicon_url=f"{root}/docs/assets/favicon.png",
    )
    nonce = getattr(request.state, NONCE_KEY, "")
    html = page.body.decode().replace("<script>", f'<script nonce="{nonce}">')
    page = type(page)(html)
    page.headers["content-security-policy"] = DOCS_CSP.format(nonce=nonce)
    return page


@router.get("/docs/assets/{name}", include_in_schema=False)
def docs_asset(name: str):
    """Swagger UI's own files, the same for everyone: no token needed."""
    if name not in ASSETS:
        raise HTTPException(404, "not a file of the API docs")
    import importlib.resources
    import importlib.util

    if importlib.util.find_spec("fastapi_offline") is None:
        raise HTTPException(501, "the API docs need the fastapi-offline package (pip install 'scaletune[serve]')")
    path = importlib.resources.files("fastapi_offline") / "static" / name
    return FileResponse(str(path), headers={"cache-control": "public, max-age=86400"})

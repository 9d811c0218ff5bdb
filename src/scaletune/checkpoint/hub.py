"""Upload an exported folder to the Hugging Face Hub with `huggingface_hub`, the token by reference
only: `HF_TOKEN` or the login cache (`hf auth login`), as `huggingface_hub.get_token` finds it.
scaletune takes no token argument, so none lands in a shell history, a saved config, a log or an
error message (the library's own errors are not repeated: they can quote request headers).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from scaletune.errors import Problem, UserError


def _repo_id_problem(repo_id: str) -> str | None:
    """Why the Hub would refuse `repo_id` as a model repo OWNER/NAME (huggingface_hub's own check),
    or None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
        if "/" not in repo_id:
            raise HFValidationError("it names no owner")
    except HFValidationError as exc:
        return f"{repo_id!r}: not a repo id OWNER/NAME ({exc})"
    return None


def _hub_offline(environ: Mapping[str, str]) -> bool:
    """Whether a process started with `environ` runs huggingface_hub offline (HF_HUB_OFFLINE true,
    as `huggingface_hub.constants` reads it)."""
    return environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


#: The command line's "no token" problem: (message, fix).
NO_TOKEN_HERE = (
    "no Hugging Face token found (HF_TOKEN, or the login cache)",
    "set HF_TOKEN in the environment or run `hf auth login`; scaletune takes no token argument",
)


def push_problems(
    repo_id: str,
    *,
    option: str = "--push-to-hub",
    check: str = "export options",
    has_token: bool | None = None,
    no_token: tuple[str, str] = NO_TOKEN_HERE,
) -> list[Problem]:
    """What stops an upload before anything is exported or sent: a repo id the Hub refuses, offline
    mode (this process's environment, which the uploading process inherits), no token. `option`
    and `check` name the request in the messages (`scaletune export --push-to-hub`; the service's
    export request, `push_to_hub`); `has_token`: whether the uploading process will hold a token
    (None: `huggingface_hub.get_token` finds one here), `no_token` the (message, fix) when not.
    Names no token value."""
    problems = []
    bad = _repo_id_problem(repo_id)
    if bad:
        problems.append(Problem(check, None, f"{option} {bad}"))
    if _hub_offline(os.environ):
        problems.append(Problem(check, None, f"{option}: HF_HUB_OFFLINE is set, so the Hub is not asked", "unset it"))
    if has_token is None:
        from huggingface_hub import get_token

        has_token = get_token() is not None
    if not has_token:
        problems.append(Problem(check, None, f"{option}: {no_token[0]}", no_token[1]))
    return problems


def push_folder(folder: Path, repo_id: str, *, private: bool = True) -> str:
    """Create `repo_id` (a model repo, private unless asked otherwise; kept if it exists) and upload
    `folder` to it in one commit. Returns the commit's URL.

    Raises:
        UserError: a problem of :func:`push_problems` (exit 2).
        RuntimeError: the Hub refused or could not be reached (the message names the repo and the
            endpoint, never the token).
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    problems = push_problems(repo_id)
    if problems:
        raise UserError(problems, title="cannot push")
    assert folder.is_dir() and any(folder.iterdir()), folder  # an export just wrote it
    api = HfApi()  # token: HF_TOKEN or the login cache, read by the library itself
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), commit_message=f"Upload {folder.name} with scaletune export"
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no"
        raise RuntimeError(
            f"the Hub at {constants.ENDPOINT} refused the upload to {repo_id} (HTTP {status}): check the token's "
            "write permission and the repo's owner"
        ) from None
    except Exception as exc:  # noqa: BLE001 - no answer (refused, reset, timed out), by whichever HTTP
        # library this huggingface_hub uses (httpx, httpx2, requests): its text is not repeated
        raise RuntimeError(
            f"the Hub at {constants.ENDPOINT} could not be reached to upload {repo_id} ({type(exc).__name__})"
        ) from None
    return str(info.commit_url)

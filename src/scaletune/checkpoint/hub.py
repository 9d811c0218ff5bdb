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


def repo_id_problem(repo_id: str) -> str | None:
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


def hub_offline(environ: Mapping[str, str]) -> bool:
    """Whether a process started with `environ` runs huggingface_hub offline (HF_HUB_OFFLINE true,
    as `huggingface_hub.constants` reads it)."""
    return environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def push_problems(repo_id: str) -> list[Problem]:
    """What stops an upload before anything is exported or sent: a repo id the Hub refuses, no
    token, offline mode."""
    from huggingface_hub import get_token

    problems = []
    bad = repo_id_problem(repo_id)
    if bad:
        problems.append(Problem("export options", None, f"--push-to-hub {bad}"))
    if hub_offline(os.environ):
        problems.append(
            Problem("export options", None, "--push-to-hub: HF_HUB_OFFLINE is set, so the Hub is not asked", "unset it")
        )
    if get_token() is None:
        problems.append(
            Problem(
                "export options",
                None,
                "--push-to-hub: no Hugging Face token found (HF_TOKEN, or the login cache)",
                "set HF_TOKEN in the environment or run `hf auth login`; scaletune takes no token argument",
            )
        )
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

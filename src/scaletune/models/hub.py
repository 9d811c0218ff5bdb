"""What a Hugging Face hub may write on this machine, and where a service's job reads models from.

Two rules, both for a service whose jobs share one machine (`scaletune serve`, issue 34):

- **A hub's answer never names a path.** huggingface_hub (2.4) joins the `ETag` of a file and
  the `X-Repo-Commit` of its repository into the cache's paths as the server sent them
  (`blobs/<etag>`, `snapshots/<commit>/`), so a hostile or compromised endpoint answering
  `ETag: "../../../../scaletune.py"` writes that file anywhere the process may write (measured:
  four files beside the cache's home). `guard_hub_answers` refuses such an answer before a byte is
  written; a real hub's are hex digests (git SHA-1, SHA-256) and pass.
- **The service's hub cache is read, never written, by its jobs.** Each job has its own Hugging
  Face home (its folder's `hf/`), and `shared_snapshot` finds a model the operator downloaded into
  the service's cache (`SCALETUNE_SHARED_HUB_CACHE`) and hands its folder to `from_pretrained`:
  no job's download can replace what another job reads (a hub that answered one job a new commit
  for `main` rewrote `refs/main` for all of them).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# Set by `scaletune serve` for its jobs: the service's Hugging Face hub cache, which a job reads and
# never writes (its own downloads go to its own HF_HOME in its folder; `serve/jobs/dispatch/base`).
SHARED_HUB_CACHE_ENV = "SCALETUNE_SHARED_HUB_CACHE"

# The answers huggingface_hub makes a path of: what the hub sends, and a CDN's own ETag (which
# huggingface_hub does not use) is held to the same rule: one name, no separator, no dot first.
_PATH_HEADERS = ("X-Repo-Commit", "X-Linked-Etag", "ETag")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


class HostileHubAnswer(RuntimeError):
    """A hub answered a header huggingface_hub would write to disk as a path outside its cache."""


def _check_answer(response) -> None:
    """httpx response hook: refuse an answer whose commit or ETag is not one plain file name."""
    for header in _PATH_HEADERS:
        value = response.headers.get(header)
        if value is None:
            continue
        name = value.removeprefix("W/").strip('"')  # as huggingface_hub reads an ETag
        if not _SAFE_NAME.fullmatch(name) or ".." in name:
            raise HostileHubAnswer(
                f"the hub at {response.request.url.host} answered {header}: {value[:80]!r}, which would be "
                "written as a path outside the download cache: refused, nothing was written. Is HF_ENDPOINT "
                "the hub you meant?"
            )


def guard_hub_answers() -> None:
    """Add `_check_answer` to huggingface_hub's shared HTTP client (its public `get_session`), once
    per client: a factory the caller set (`set_client_factory`, for a proxy or certificates) is kept.
    Idempotent; called before every hub download scaletune starts."""
    from huggingface_hub import get_session

    session = get_session()
    hooks = session.event_hooks
    if _check_answer not in hooks["response"]:
        session.event_hooks = {**hooks, "response": [*hooks["response"], _check_answer]}


def _weights_complete(folder: Path) -> bool:
    """Whether a snapshot folder holds a whole checkpoint: a single weights file, or an index whose
    every shard is there (a snapshot that only a config check fetched has none)."""
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (folder / single).is_file():
            return True
        try:
            shards = set(json.loads((folder / index).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        return all((folder / s).is_file() for s in shards)
    return False


def shared_snapshot(name: str, revision: str | None, *, need_config: bool) -> Path | None:
    """The folder of hub id `name` at `revision` (default `main`) in the shared hub cache that
    `SCALETUNE_SHARED_HUB_CACHE` names, when it holds a whole model (`need_config`: config.json and
    every weights file) or a tokenizer; else None. Read only: nothing is fetched or written there."""
    root = os.environ.get(SHARED_HUB_CACHE_ENV)
    if not root or not Path(root).is_dir():
        return None
    from huggingface_hub import try_to_load_from_cache

    for marker in ("config.json",) if need_config else ("tokenizer_config.json", "tokenizer.json"):
        hit = try_to_load_from_cache(name, marker, cache_dir=root, revision=revision)
        if isinstance(hit, str):
            folder = Path(hit).parent
            if not need_config or _weights_complete(folder):
                return folder
    return None

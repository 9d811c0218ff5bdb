"""models/hub.py: which snapshot of the service's shared hub cache a job reads in place (a whole
one only), and which hub answers are refused before a download writes them."""

from __future__ import annotations

import shutil

import httpx
import pytest

from scaletune.models.hub import SHARED_HUB_CACHE_ENV, HostileHubAnswer, _check_answer, shared_snapshot


def _cache(root, tiny_model_dir, keep: set[str], commit: str = "a" * 40):
    """`owner/tiny` in the hub cache layout under `root` at `commit` (refs/main), with `keep` of its files."""
    snap = root / "models--owner--tiny" / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "models--owner--tiny" / "refs").mkdir()
    (root / "models--owner--tiny" / "refs" / "main").write_text(commit)
    for name in keep:
        shutil.copy(tiny_model_dir / name, snap / name)
    return snap


def test_only_a_whole_model_is_read_in_place(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_HUB_CACHE_ENV, str(tmp_path))
    snap = _cache(tmp_path, tiny_model_dir, {"config.json", "tokenizer.json", "tokenizer_config.json"})
    # A config check fetched config.json only: the model is not there, the tokenizer is.
    assert shared_snapshot("owner/tiny", None, need_config=True) is None
    assert shared_snapshot("owner/tiny", None, need_config=False) == snap
    shutil.copy(tiny_model_dir / "model.safetensors", snap / "model.safetensors")
    assert shared_snapshot("owner/tiny", None, need_config=True) == snap
    assert shared_snapshot("owner/tiny", "a" * 40, need_config=True) == snap
    assert shared_snapshot("owner/tiny", "v2", need_config=True) is None  # another revision: the hub's
    assert shared_snapshot("owner/other", None, need_config=True) is None
    monkeypatch.delenv(SHARED_HUB_CACHE_ENV)
    assert shared_snapshot("owner/tiny", None, need_config=True) is None  # outside a service: the hub as ever


def test_a_sharded_model_needs_every_shard(tiny_model_dir, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv(SHARED_HUB_CACHE_ENV, str(tmp_path))
    snap = _cache(tmp_path, tiny_model_dir, {"config.json"})
    index = {
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    }
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    (snap / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert shared_snapshot("owner/tiny", None, need_config=True) is None
    (snap / "model-00002-of-00002.safetensors").write_bytes(b"x")
    assert shared_snapshot("owner/tiny", None, need_config=True) == snap


@pytest.mark.parametrize(
    "header, value",
    [
        ("ETag", '"../../../../scaletune.py"'),
        ("ETag", 'W/"/etc/cron.d/x"'),
        ("X-Linked-Etag", '"sub/dir"'),
        ("X-Repo-Commit", ".."),
        ("X-Repo-Commit", "../refs"),
        ("ETag", '""'),
    ],
)
def test_an_answer_that_names_a_path_is_refused(header, value):
    response = httpx.Response(200, headers={header: value}, request=httpx.Request("HEAD", "http://hub.test/o/n"))
    with pytest.raises(HostileHubAnswer, match=header):
        _check_answer(response)


def test_a_real_hubs_answers_pass():
    # The hub's own: a git blob SHA-1, an LFS SHA-256 (weak and strong), a commit; a CDN's multipart ETag.
    headers = {
        "X-Repo-Commit": "4d6e4a2b2f1f0c6f0f0b9ad3c1d3a2f0e6f7a8b9",
        "ETag": 'W/"1f0c6f0f0b9ad3c1d3a2f0e6f7a8b94d6e4a2b2f"',
        "X-Linked-Etag": '"' + "ab" * 32 + '"',
    }
    _check_answer(httpx.Response(200, headers=headers, request=httpx.Request("HEAD", "http://hub.test/o/n")))
    cdn = {"ETag": '"9b2cf535f27731c974343645a3985328-3"'}
    _check_answer(httpx.Response(200, headers=cdn, request=httpx.Request("GET", "http://cdn.test/x")))

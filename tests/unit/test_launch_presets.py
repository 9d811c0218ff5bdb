"""NCCL / torch.distributed environment presets and their merge with distributed.env."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletune.errors import UserError
from scaletune.launch.presets import PRESETS, merged_env, preset_env, split_secrets

DOCS = Path(__file__).resolve().parents[2] / "docs" / "launch.md"


def test_known_presets():
    assert preset_env(["no-p2p"]) == {"NCCL_P2P_DISABLE": "1"}
    assert preset_env(["no-ib"]) == {"NCCL_IB_DISABLE": "1"}
    d = preset_env(["debug"])
    assert (
        d["NCCL_DEBUG"] == "INFO"
        and d["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
        and d["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    )
    assert preset_env(["socket-ifname=eth0"]) == {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    assert preset_env(["socket-ifname=^docker,lo"])["NCCL_SOCKET_IFNAME"] == "^docker,lo"
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in preset_env(["long-timeouts"])


def test_order_config_then_presets():
    env = merged_env({"NCCL_DEBUG": "WARN", "A": "1"}, ["debug"])
    assert env["NCCL_DEBUG"] == "INFO" and env["A"] == "1"
    assert list(env)[:2] == ["NCCL_DEBUG", "A"]


@pytest.mark.parametrize(
    "bad, msg",
    [
        ("turbo", "unknown env preset"),
        ("socket-ifname", "needs a value"),
        ("debug=1", "takes no value"),
        ("socket-ifname=eth0;id", "not an interface"),
    ],
)
def test_bad_presets(bad, msg):
    with pytest.raises(UserError, match=msg):
        preset_env([bad])


def test_invalid_variable_name():
    with pytest.raises(UserError, match="not a valid environment variable name"):
        merged_env({"A=B": "1"})


def test_split_secrets():
    public, secret = split_secrets({"HF_TOKEN": "x", "WANDB_API_KEY": "y", "NCCL_DEBUG": "INFO"})
    assert public == {"NCCL_DEBUG": "INFO"} and secret == ["HF_TOKEN", "WANDB_API_KEY"]


def test_every_preset_documented_with_its_symptom():
    text = DOCS.read_text()
    for p in PRESETS.values():
        assert f"`{p.name}" in text, f"docs/launch.md does not document preset {p.name}"
        for var in p.env:
            assert var in text, f"docs/launch.md does not mention {var}"

"""NCCL's and gloo's interface variables, derived separately (issue 20): the `socket-ifname` preset,
the node-side derivation of GLOO_SOCKET_IFNAME from NCCL's rule, and the doctor's check of it."""

from __future__ import annotations

import socket

from scaletune import doctor
from scaletune.env import DistributedEnv
from scaletune.launch.presets import preset_env
from scaletune.strategies.process_group import (
    derive_gloo_ifname,
    gloo_interface,
    nccl_interface_matches,
)

# (name, up with an address, loopback), in the host's order
HOST = [
    ("lo", True, True),
    ("docker0", True, False),
    ("eth0", True, False),
    ("eth1", True, False),
    ("ib0", False, False),
]
TWO_RANKS = DistributedEnv("torchrun", world_size=2, local_world_size=2)


def test_preset_gives_gloo_names_only():
    assert preset_env(["socket-ifname=eth0"]) == {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    assert preset_env(["socket-ifname==eth0,eth1"]) == {
        "NCCL_SOCKET_IFNAME": "=eth0,eth1",
        "GLOO_SOCKET_IFNAME": "eth0,eth1",
    }
    # gloo has no '^' exclusion: the preset leaves its variable to the node.
    assert preset_env(["socket-ifname=^docker,lo"]) == {"NCCL_SOCKET_IFNAME": "^docker,lo"}
    # a later preset wins whole, gloo's variable included
    assert preset_env(["socket-ifname=eth0", "socket-ifname=^docker"]) == {"NCCL_SOCKET_IFNAME": "^docker"}


def test_nccl_rule_as_its_documentation_states_it():
    names = ["lo", "docker0", "eth0", "eth1", "ib0"]
    assert nccl_interface_matches("eth", names) == ["eth0", "eth1"]  # prefixes
    assert nccl_interface_matches("=eth", names) == []  # exact names
    assert nccl_interface_matches("=eth1,ib0", names) == ["eth1", "ib0"]
    assert nccl_interface_matches("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nccl_interface_matches("^=docker", names) == names  # no interface is exactly 'docker'


def test_gloo_gets_one_concrete_interface_that_is_up():
    assert gloo_interface("^docker,lo", HOST) == "eth0"
    assert gloo_interface("^docker,eth0", HOST) == "eth1"  # lo only where nothing else matches
    assert gloo_interface("ib", HOST) is None  # ib0 is down
    assert gloo_interface("lo", HOST) == "lo"


def test_derivation_keeps_what_the_user_set():
    environ = {"NCCL_SOCKET_IFNAME": "^docker,lo"}
    derive_gloo_ifname(environ, HOST)
    assert environ["GLOO_SOCKET_IFNAME"] == "eth0"
    environ = {"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth1"}
    derive_gloo_ifname(environ, HOST)
    assert environ["GLOO_SOCKET_IFNAME"] == "eth1"
    environ = {"NCCL_SOCKET_IFNAME": "ib"}
    derive_gloo_ifname(environ, HOST)
    assert "GLOO_SOCKET_IFNAME" not in environ
    environ = {}
    derive_gloo_ifname(environ, HOST)
    assert environ == {}


def test_doctor_checks_gloo_names():
    real = socket.if_nameindex()[0][1]
    fails = {
        value: [
            c for c in doctor.check_nccl_env(TWO_RANKS, {"GLOO_SOCKET_IFNAME": value}) if c.name == "GLOO_SOCKET_IFNAME"
        ]
        for value in (f"^docker,{real}", "nosuchif0", f"={real}", real, real[:-1] if len(real) > 1 else real)
    }
    assert fails[f"^docker,{real}"][0].status == "FAIL" and fails[f"^docker,{real}"][0].fatal
    assert "exclusion" in fails[f"^docker,{real}"][0].message
    assert fails["nosuchif0"][0].status == "FAIL"
    assert fails[f"={real}"][0].status == "FAIL"
    assert fails[real] == []
    if len(real) > 1:
        assert fails[real[:-1]][0].status == "FAIL"  # a prefix is not a name to gloo

"""Exact-output tests of the torchrun / deepspeed-launcher command builders (scaletune.launch.commands);
the scripts they write are run by bash in tests/e2e/test_launch_scripts.py."""

from __future__ import annotations

import shlex

import pytest

from scaletune.errors import UserError
from scaletune.launch.commands import LaunchOptions, build_launch, endpoint, single_node_torchrun_argv

PY = "/venv/bin/python"


def test_single_node_torchrun_standalone():
    cmd = build_launch(LaunchOptions(config="cfg.yaml", gpus_per_node=8, python=PY))
    assert cmd.argv == [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "8",
        "-m",
        "scaletune",
        "train",
        "cfg.yaml",
    ]
    assert cmd.env == {} and cmd.role == "master" and cmd.files == {}


def test_single_node_all_gpus_by_default_and_overrides_passed():
    cmd = build_launch(LaunchOptions(config="c.yaml", overrides=("training.max_steps=3", "seed=1"), python=PY))
    assert cmd.argv[cmd.argv.index("--nproc-per-node") + 1] == "gpu"
    assert cmd.argv[-5:] == ["scaletune", "train", "c.yaml", "training.max_steps=3", "seed=1"]


def test_config_num_processes_is_the_default_rank_count():
    def nproc(**kw):
        argv = build_launch(LaunchOptions(config="c.yaml", **kw)).argv
        return argv[argv.index("--nproc-per-node") + 1]

    assert nproc(config_num_processes=3) == "3"
    assert nproc(config_num_processes="auto") == "gpu"
    assert nproc(config_num_processes=3, gpus_per_node=8) == "8"  # the command line wins
    assert nproc(config_num_processes=3, gpus_per_node=0, procs_per_node=2) == "2"


def test_single_node_with_port_uses_c10d_on_loopback():
    cmd = build_launch(LaunchOptions(config="c.yaml", gpus_per_node=2, master_port=29600, python=PY))
    assert cmd.argv == [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29600",
        "--rdzv-id",
        "scaletune-29600",
        "--nproc-per-node",
        "2",
        "-m",
        "scaletune",
        "train",
        "c.yaml",
    ]


def test_multi_node_master_and_worker():
    base = dict(config="c.yaml", nodes=2, gpus_per_node=8, master_addr="10.1.2.3", master_port=29400, python=PY)
    master = build_launch(LaunchOptions(**base, node_rank=0))
    worker = build_launch(LaunchOptions(**base, node_rank=1))
    common = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.2.3:29400", "--rdzv-id", "scaletune-29400"]
    assert master.argv == [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        *common,
        "--rdzv-conf",
        "is_host=1",
        "--nproc-per-node",
        "8",
        "-m",
        "scaletune",
        "train",
        "c.yaml",
    ]
    assert worker.argv == [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        *common,
        "--rdzv-conf",
        "is_host=0",
        "--nproc-per-node",
        "8",
        "-m",
        "scaletune",
        "train",
        "c.yaml",
    ]
    assert (master.role, worker.role) == ("master", "worker")
    assert "rendezvous at 10.1.2.3:29400" in worker.summary


def test_multi_node_default_port_and_rdzv_id():
    cmd = build_launch(
        LaunchOptions(config="c.yaml", nodes=3, node_rank=2, gpus_per_node=4, master_addr="head", rdzv_id="job-7")
    )
    assert "head:29500" in cmd.argv and cmd.argv[cmd.argv.index("--rdzv-id") + 1] == "job-7"


def test_ipv6_master_is_bracketed():
    assert endpoint("fe80::1", 29500) == "[fe80::1]:29500"
    assert endpoint("[::1]", 1) == "[::1]:1"


def test_cpu_nodes_use_procs_per_node():
    cmd = build_launch(LaunchOptions(config="c.yaml", gpus_per_node=0, procs_per_node=4, python=PY))
    assert cmd.argv[cmd.argv.index("--nproc-per-node") + 1] == "4"


def test_restarts():
    cmd = build_launch(LaunchOptions(config="c.yaml", gpus_per_node=2, max_restarts=3, python=PY))
    i = cmd.argv.index("--max-restarts")
    assert cmd.argv[i + 1] == "3" and i < cmd.argv.index("-m", 3)
    assert "--max-restarts" not in build_launch(LaunchOptions(config="c.yaml", gpus_per_node=2)).argv


def test_deepspeed_single_node():
    cmd = build_launch(LaunchOptions(config="c.yaml", gpus_per_node=4, launcher="deepspeed", python=PY))
    assert cmd.argv == [
        PY,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "4",
        "--master_port",
        "29500",
        "--no_local_rank",
        "--module",
        "scaletune",
        "train",
        "c.yaml",
    ]


def test_deepspeed_all_gpus_omits_num_gpus():
    cmd = build_launch(LaunchOptions(config="c.yaml", launcher="deepspeed", python=PY))
    assert "--num_gpus" not in cmd.argv


def test_deepspeed_multi_node_uses_no_ssh_and_a_hostfile():
    cmd = build_launch(
        LaunchOptions(
            config="c.yaml",
            nodes=2,
            node_rank=1,
            gpus_per_node=8,
            master_addr="10.0.0.1",
            launcher="deepspeed",
            hostfile="/tmp/hf",
            python=PY,
        )
    )
    assert cmd.argv == [
        PY,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        "/tmp/hf",
        "--no_ssh",
        "--node_rank",
        "1",
        "--num_nodes",
        "2",
        "--master_addr",
        "10.0.0.1",
        "--num_gpus",
        "8",
        "--master_port",
        "29500",
        "--no_local_rank",
        "--module",
        "scaletune",
        "train",
        "c.yaml",
    ]
    assert cmd.files == {"/tmp/hf": "node-0 slots=8\nnode-1 slots=8\n"}


def test_deepspeed_runner_parses_the_argv():
    """The deepspeed launcher's own argument parser accepts what we build."""
    pytest.importorskip("deepspeed")
    from deepspeed.launcher.runner import parse_args

    cmd = build_launch(
        LaunchOptions(
            config="c.yaml",
            overrides=("seed=3",),
            nodes=2,
            node_rank=1,
            gpus_per_node=8,
            master_addr="10.0.0.1",
            launcher="deepspeed",
            hostfile="/tmp/hf",
            python=PY,
        )
    )
    args = parse_args(cmd.argv[3:])
    assert (args.no_ssh, args.node_rank, args.num_nodes, args.num_gpus, args.master_addr) == (True, 1, 2, 8, "10.0.0.1")
    assert args.module and args.no_local_rank and args.user_script == "scaletune"
    assert args.user_args == ["train", "c.yaml", "seed=3"]


def test_torchrun_parses_the_argv():
    """torchrun's own parser accepts what we build (no torch import in the builder; here it is fine)."""
    from torch.distributed.run import get_args_parser

    cmd = build_launch(
        LaunchOptions(
            config="c.yaml",
            overrides=("seed=3",),
            nodes=2,
            node_rank=1,
            gpus_per_node=0,
            procs_per_node=2,
            master_addr="h",
            master_port=1234,
            max_restarts=2,
            python=PY,
        )
    )
    args = get_args_parser().parse_args(cmd.argv[3:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.max_restarts) == ("2", "2", 1, 2)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf) == ("c10d", "h:1234", "is_host=0")
    assert args.module and args.training_script == "scaletune"
    assert args.training_script_args == ["train", "c.yaml", "seed=3"]


def test_single_node_torchrun_argv_for_reexec():
    assert single_node_torchrun_argv(PY, 2, ["c.yaml", "seed=1"]) == [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "-m",
        "scaletune",
        "train",
        "c.yaml",
        "seed=1",
    ]
    argv = single_node_torchrun_argv(PY, 4, ["c.yaml"], master_port=29555, max_restarts=1)
    assert argv[3:12] == [
        "--nnodes",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29555",
        "--rdzv-id",
        "scaletune-29555",
        "--nproc-per-node",
    ]
    assert argv[argv.index("--max-restarts") + 1] == "1"
    with pytest.raises(UserError):
        single_node_torchrun_argv(PY, 0, ["c.yaml"])
    with pytest.raises(UserError):
        single_node_torchrun_argv(PY, 2, ["c.yaml"], master_port=0)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(nodes=2, node_rank=2, master_addr="h"), "--node-rank 2 is outside 0..1"),
        (dict(nodes=2, node_rank=-1, master_addr="h"), "--node-rank -1 is outside 0..1"),
        (dict(master_port=0), "between 1 and 65535"),
        (dict(master_port=65536), "between 1 and 65535"),
        (dict(gpus_per_node=0), "needs --procs-per-node"),
        (dict(gpus_per_node=2, procs_per_node=4), "ranks would share a GPU"),
        (dict(nodes=2), "needs --master-addr"),
        (dict(launcher="mpirun"), "--launcher must be one of"),
        (dict(launcher="deepspeed", max_restarts=1), "needs --launcher torchrun"),
        (dict(env_presets=("fast",)), "unknown env preset 'fast'"),
        (dict(master_addr="a b"), "is not a host name"),
        (dict(config_env={"BAD NAME": "1"}), "not a valid environment variable name"),
    ],
)
def test_bad_input_is_a_user_error(kw, message):
    with pytest.raises(UserError) as exc:
        build_launch(LaunchOptions(config="c.yaml", **kw))
    assert message in exc.value.format()


def test_all_problems_reported_at_once():
    with pytest.raises(UserError) as exc:
        build_launch(LaunchOptions(config="c.yaml", nodes=2, node_rank=5, master_port=99999, gpus_per_node=0))
    assert len(exc.value.problems) == 4


def test_dry_run_text_is_shell_and_hides_secrets():
    cmd = build_launch(
        LaunchOptions(
            config="my config.yaml",
            gpus_per_node=2,
            python=PY,
            config_env={"HF_TOKEN": "hf_secret", "NCCL_SOCKET_IFNAME": "eth0"},
            env_presets=("no-ib",),
        )
    )
    text = cmd.dry_run_text()
    assert "hf_secret" not in text
    assert "export NCCL_SOCKET_IFNAME=eth0\nexport NCCL_IB_DISABLE=1\n" in text
    assert "# HF_TOKEN: secret, taken from the caller's environment" in text
    assert text.rstrip().endswith("-m scaletune train 'my config.yaml'")
    assert cmd.env["HF_TOKEN"] == "hf_secret" and cmd.secret_names == ["HF_TOKEN"]
    assert shlex.split(text.strip().splitlines()[-1])[0] == PY


def test_script_never_contains_secret_values(tmp_path):
    cmd = build_launch(
        LaunchOptions(
            config="c.yaml",
            nodes=2,
            node_rank=1,
            master_addr="10.0.0.1",
            gpus_per_node=2,
            config_env={"WANDB_API_KEY": "k-123", "X": "1"},
        )
    )
    script = cmd.script(workdir="/work dir")
    assert "k-123" not in script
    assert "WANDB_API_KEY" in script and "passed through from the\n# environment" in script
    assert script.startswith("#!/usr/bin/env bash\n") and "cd '/work dir'\n" in script
    assert "export X=1\n" in script  # bash parses it: tests/e2e/test_launch_scripts.py

"""Each doctor check, provoked: DistributedEnv values and environment dicts passed in, real
sockets for the port, fixed (and real) disk numbers, a real DeepSpeed op builder."""

from __future__ import annotations

import collections
import gc
import shutil
import socket
import time

import pytest

from scaletune import doctor
from scaletune.doctor import Check, checks, preflight
from scaletune.env import DistributedEnv
from scaletune.errors import UserError
from scaletune.resolve import decide
from tests.helpers import make_config, make_env

NONE = make_env()
GPU8 = make_env(gpus=8)

# What the doctor's runs change in make_config's: Llama 3.2 1B (a preset, no weights) in bfloat16
# on dummy rows of 128 tokens, the strategy and process count left to decide.
RUN = {
    "model": {"dtype": "bfloat16"},
    "data": {"train": None, "dummy": {}, "max_seq_length": 128},
    "distributed": {"strategy": None, "num_processes": None},
}


def cfg(tmp_path, env=None, world_size=None, **sections):
    """The run of a small config (`sections` over RUN), decided for `env` (default: one plain process)."""
    config = make_config("llama-3.2-1b", tmp_path / "run", RUN, as_config=True, **sections)
    return decide(config, env or NONE, world_size=world_size)


def env_from(environ: dict) -> DistributedEnv:
    return DistributedEnv.from_environ(environ, probe_cuda=False)


def by_name(results: list[Check], name: str) -> Check:
    return next(c for c in results if c.name == name)


# -- distributed variables ------------------------------------------------------------------


def test_stale_world_size_without_launcher_is_fatal():
    environ = {"WORLD_SIZE": "4", "RANK": "0"}
    c = doctor.check_launcher_vars(env_from(environ), environ)
    assert c.status == "FAIL" and c.fatal and "MASTER_ADDR and MASTER_PORT" in c.message and "unset" in c.fix


def test_world_size_disagreeing_with_slurm_is_fatal():
    environ = {
        "WORLD_SIZE": "4",
        "RANK": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
    }
    c = doctor.check_launcher_vars(env_from(environ), environ)
    assert c.status == "FAIL" and c.fatal and "SLURM" in c.message


def test_external_launcher_with_rendezvous_is_ok_and_world1_leftover_warns():
    environ = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    assert doctor.check_launcher_vars(env_from(environ), environ).status == "OK"
    environ = {"WORLD_SIZE": "1", "RANK": "0"}
    assert doctor.check_launcher_vars(env_from(environ), environ).status == "WARN"
    environ = {"MASTER_PORT": "1234"}
    assert doctor.check_launcher_vars(env_from(environ), environ).status == "WARN"
    environ = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert doctor.check_launcher_vars(env_from(environ), environ).status == "OK"


# -- devices ---------------------------------------------------------------------------------


def test_more_processes_than_gpus(tmp_path):
    env = make_env(8, gpus=4)
    c = doctor.check_processes_vs_gpus(env, None, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert c.status == "FAIL" and c.fatal and "4 visible GPU" in c.message
    c = doctor.check_processes_vs_gpus(GPU8, cfg(tmp_path, GPU8, distributed={"num_processes": 16}), {})
    assert c.status == "FAIL" and "num_processes is 16" in c.message
    assert doctor.check_processes_vs_gpus(GPU8, cfg(tmp_path, GPU8), {}).status == "OK"


def test_device_map_with_launcher_warns(tmp_path):
    env = make_env(2)
    c = cfg(tmp_path, env, model={"device_map": "auto"})
    assert doctor.check_device_map(env, c).status == "WARN"
    assert doctor.check_device_map(NONE, cfg(tmp_path, model={"device_map": "auto"})).status == "OK"


# -- quantization ----------------------------------------------------------------------------


def test_quantization_without_gpu_is_fatal(tmp_path):
    c = cfg(tmp_path, model={"lora": {"r": 8}, "quantization": {"bits": 4}})
    res = doctor.check_quantization(NONE, c)
    assert res[0].status == "FAIL" and res[0].fatal and "CUDA GPU" in res[0].message


# -- liger -----------------------------------------------------------------------------------


def test_liger_without_gpu_or_package_is_fatal(tmp_path):
    assert doctor.check_liger(NONE, cfg(tmp_path)).status == "OK"
    c = cfg(tmp_path, model={"liger": True})
    res = doctor.check_liger(NONE, c)
    assert res.status == "FAIL" and res.fatal and "needs a CUDA GPU" in res.message and "model.liger: false" in res.fix
    if doctor.installed_version("liger-kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    res = doctor.check_liger(GPU8, c)  # a GPU machine without the package (really absent here)
    assert res.status == "FAIL" and res.fatal and "liger-kernel" in res.message and "scaletune[liger]" in res.fix
    assert by_name(checks(c, NONE, {}), "liger").status == "FAIL"


def test_mlflow_without_the_package_is_fatal_naming_the_extra(tmp_path, monkeypatch):
    assert doctor.check_mlflow(cfg(tmp_path)).message == "logging.mlflow off"
    c = cfg(tmp_path, logging={"mlflow": {"experiment": "x"}})
    if doctor.installed_version("mlflow-skinny") or doctor.installed_version("mlflow"):
        assert doctor.check_mlflow(c).status == "OK"  # control: the same run with mlflow importable
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)  # `import mlflow` fails, as when absent
    res = doctor.check_mlflow(c)
    assert res.status == "FAIL" and res.fatal and "logging.mlflow needs the mlflow package" in res.message
    assert res.fix == "pip install 'scaletune[mlflow]'"
    assert by_name(checks(c, NONE, {}), "mlflow").status == "FAIL"


def _bypass(c, **quant):
    """A run with a setting the resolve rules refuse (the doctor must show it, e.g. from the Python API)."""
    import dataclasses

    m = c.config.model
    q = m.quantization.model_copy(update=quant)
    return dataclasses.replace(
        c, config=c.config.model_copy(update={"model": m.model_copy(update={"quantization": q})})
    )


def test_quantization_with_sharding_strategies(tmp_path):
    base = cfg(
        tmp_path,
        GPU8,
        model={"lora": {"r": 8}, "quantization": {"bits": 4, "storage_dtype": "bfloat16"}},
        distributed={"strategy": "deepspeed", "zero_stage": 3},
    )
    assert doctor.check_quantization(GPU8, base)[1].status == "OK"
    # FSDP + QLoRA is refused (issue 16): rank 0 loads 4-bit weights, the others build meta ones.
    fsdp = cfg(
        tmp_path,
        GPU8,
        model={"lora": {"r": 8}, "quantization": {"bits": 4, "storage_dtype": "bfloat16"}},
        distributed={"strategy": "fsdp"},
    )
    c = doctor.check_quantization(GPU8, fsdp)[1]
    assert c.status == "FAIL" and "strategy ddp" in c.fix
    bad_storage = _bypass(base, storage_dtype="uint8")
    c = doctor.check_quantization(GPU8, bad_storage)[1]
    assert c.status == "FAIL" and c.name == "quantization storage dtype" and "storage_dtype: bfloat16" in c.fix
    eight = _bypass(base, bits=8)
    c = doctor.check_quantization(GPU8, eight)[1]
    assert c.status == "FAIL" and "8-bit" in c.message


# -- checkpointing ---------------------------------------------------------------------------


def test_reentrant_checkpointing_under_ddp_with_lora(tmp_path, monkeypatch):
    from scaletune import models

    env = make_env(2)
    c = cfg(tmp_path, env, model={"lora": {"r": 8}, "gradient_checkpointing": True}, distributed={"strategy": "ddp"})
    assert doctor.check_checkpointing(env, c).status == "OK"
    original = models.enable_gradient_checkpointing

    def reentrant(model, *, use_reentrant=True):  # what a regression to the reentrant default looks like
        return original(model, use_reentrant=use_reentrant)

    monkeypatch.setattr(models, "enable_gradient_checkpointing", reentrant)
    res = doctor.check_checkpointing(env, c)
    assert res.status == "FAIL" and res.fatal and "mark a variable ready only once" in res.message


# -- batch -----------------------------------------------------------------------------------


def test_batch_arithmetic(tmp_path):
    c = cfg(tmp_path, training={"global_batch_size": 8, "micro_batch_size": 2})
    assert doctor.check_batch(c).status == "OK"
    res = doctor.check_batch(cfg(tmp_path, world_size=3, training={"global_batch_size": 8, "micro_batch_size": 2}))
    assert res.status == "FAIL" and res.fatal and "multiple of" in res.message


# -- DeepSpeed ops ---------------------------------------------------------------------------


def test_deepspeed_cpu_adam_builds_here(tmp_path):
    # ZeRO-Offload on GPUs steps with DeepSpeed's CPU Adam: the doctor asks its builder (a real one).
    c = cfg(tmp_path, GPU8, distributed={"strategy": "deepspeed", "offload_optimizer": True, "zero_stage": 2})
    res = doctor.check_deepspeed_ops(c)
    assert res.status == "OK" and "CPUAdamBuilder compatible" in res.message
    # Without GPUs the run steps with torch's AdamW (steps_with_cpu_adam): no op to build.
    cpu = cfg(tmp_path, distributed={"strategy": "deepspeed", "offload_optimizer": True, "zero_stage": 2})
    res = doctor.check_deepspeed_ops(cpu)
    assert res.status == "OK" and "no custom op needed" in res.message


def test_deepspeed_op_that_cannot_build(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False):
        pytest.skip("libaio is installed here: async_io builds")
    c = doctor.check_deepspeed_ops(None, builders=["AsyncIOBuilder"])
    assert c.status == "FAIL" and c.fatal and "AsyncIOBuilder" in c.message and "ds_report" in c.fix


# -- NCCL ------------------------------------------------------------------------------------


def test_nccl_variables():
    env = make_env(2, gpus=2)
    res = doctor.check_nccl_env(
        env,
        {
            "NCCL_SOCKET_IFNAME": "nosuchif0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "NCCL_P2P_DISABLE": "1",
            "CUDA_LAUNCH_BLOCKING": "1",
        },
    )
    names = {c.name: c for c in res}
    assert names["NCCL_SOCKET_IFNAME"].status == "FAIL" and names["NCCL_SOCKET_IFNAME"].fatal
    assert names["TORCH_NCCL_ASYNC_ERROR_HANDLING"].status == "WARN"
    assert names["NCCL_P2P_DISABLE"].status == "WARN"
    assert names["CUDA_LAUNCH_BLOCKING"].status == "WARN"
    real = socket.if_nameindex()[0][1]
    assert doctor.check_nccl_env(env, {"NCCL_SOCKET_IFNAME": real})[0].status == "OK"


# -- disk ------------------------------------------------------------------------------------


LLAMA_32_1B = 1_235_814_400  # parameters of Llama 3.2 1B (tied embeddings), as published
# LoRA r=8 on q, k, v, o, gate, up, down of its 16 layers: r x (in + out) per module, from the
# published shapes (hidden 2048, 8 KV heads of 64, MLP 8192).
LORA_R8 = 16 * 8 * ((2048 + 2048) * 2 + (2048 + 512) * 2 + (2048 + 8192) * 3)
Usage = collections.namedtuple("Usage", "total used free")  # what shutil.disk_usage returns


@pytest.fixture
def disk_free(monkeypatch):
    """Fixes the free bytes `check_disk` sees (the doctor module's `shutil.disk_usage`) and
    records the paths it asked about."""
    from scaletune.doctor import system

    state = {"free": 0, "asked": []}

    def fake_usage(path):
        state["asked"].append(path)
        return Usage(total=10**15, used=10**15 - state["free"], free=state["free"])

    monkeypatch.setattr(system.shutil, "disk_usage", fake_usage)
    return state


@pytest.mark.parametrize(
    ("case", "sections", "need_min", "need"),
    [
        # bf16 full fine-tuning, keep_last 2: final 2 B/param, each checkpoint 12 B/param (fp32
        # weights + Adam's two moments): one checkpoint + final = 14 N; the peak is the two kept
        # and a third being written (the oldest is pruned once it is complete) = 36 N.
        ("full bf16", {}, 14 * LLAMA_32_1B, 36 * LLAMA_32_1B),
        # fp32 final (4 B/param), keep_last 3: 16 N and 4 x 12 N = 48 N.
        (
            "full fp32 keep 3",
            {"model": {"dtype": "float32"}, "training": {"keep_last": 3}},
            16 * LLAMA_32_1B,
            48 * LLAMA_32_1B,
        ),
        # LoRA: the adapters train (the planner's meta-model count), final and checkpoints in
        # fp32: 4 t + 12 t and 3 x 12 t.
        ("lora", {"model": {"lora": {"r": 8}}}, 16 * LORA_R8, 36 * LORA_R8),
        # no periodic checkpoints: only the final model (no WARN band).
        ("no saves", {"training": {"save_every": 0}}, 2 * LLAMA_32_1B, 2 * LLAMA_32_1B),
    ],
)
def test_free_disk_thresholds(tmp_path, disk_free, case, sections, need_min, need):
    """FAIL (fatal) below the final model plus one checkpoint, WARN below the peak (every kept
    checkpoint and the one being written), OK from there: checked one byte either side of each threshold, with fixed free bytes."""
    spec = cfg(tmp_path, **sections)
    if need > need_min:
        expected = {need_min - 1: "FAIL", need_min: "WARN", need - 1: "WARN", need: "OK"}
    else:
        expected = {need - 1: "FAIL", need: "OK"}
    for free, status in sorted(expected.items()):
        disk_free["free"] = free
        c = doctor.check_disk(spec)
        assert (c.status, c.fatal) == (status, status == "FAIL"), f"{case}: {free} bytes free -> {c}"
        assert f"{free / 1e9:,.1f} GB free at {tmp_path.resolve()}" in c.message
    # output_dir does not exist yet: its nearest existing parent is what is measured.
    assert set(disk_free["asked"]) == {tmp_path.resolve()}


def test_free_disk_real_disk_fails_for_a_70b_run(tmp_path):
    """The real `shutil.disk_usage` (no patch): 50 checkpoints of a 70B model (~42 TB) fit nowhere."""
    huge = doctor.check_disk(cfg(tmp_path, model={"name_or_path": "llama-3-70b"}, training={"keep_last": 50}))
    assert 70e9 * 12 > shutil.disk_usage(tmp_path).free, "this disk is too large for the test's model"
    assert huge.status == "FAIL" and huge.fatal and "GB free" in huge.message


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_full_finetune_is_counted_from_the_headers_as_the_meta_model_counts_it(tmp_path, fixture, request):
    """A full fine-tune of a local safetensors folder is sized from the files' headers (no model
    built): the same total the planner's meta model counts (OLMo-2 tiny: untied head; Llama tiny:
    tied embeddings, stored once), the trainable count the same; a LoRA run still builds it."""
    from scaletune.doctor.system import _parameters
    from scaletune.plan.shapes import model_shape

    model = request.getfixturevalue(fixture)
    full = cfg(tmp_path, model={"name_or_path": str(model)})
    meta = model_shape(full)
    assert _parameters(full) == (meta.total, meta.trainable) == (meta.total, meta.total)
    lora = cfg(tmp_path, model={"name_or_path": str(model), "lora": {"r": 8}})
    shape = model_shape(lora)
    assert _parameters(lora) == (shape.total, shape.trainable) and shape.trainable < shape.total


# -- port ------------------------------------------------------------------------------------


def test_port_taken():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        c = doctor.check_port(env_from(environ), environ)
        assert c.status == "FAIL" and c.fatal and str(port) in c.message
        c = doctor.check_port(NONE, {"MASTER_PORT": str(port)})
        assert c.status == "WARN"
        tr = {**environ, "TORCHELASTIC_RUN_ID": "x"}
        assert doctor.check_port(env_from(tr), tr).status == "OK"  # torchrun's agent holds it
    assert doctor.check_port(env_from(environ), environ).status == "OK"


# -- preflight -------------------------------------------------------------------------------


def test_preflight_names_every_fatal_problem_fast(tmp_path):
    environ = {"WORLD_SIZE": "3", "RANK": "0"}
    c = cfg(tmp_path, env_from(environ), model={"lora": {"r": 8}, "quantization": {"bits": 4}})
    with pytest.raises(UserError):
        preflight(c, environ)  # the modules it imports on first use, outside the measure
    # This thread's CPU, not the wall clock: a loaded machine (CI's other worker) stretches the latter.
    # Without the garbage collector's full passes, which a test worker holding the objects of earlier
    # tests pays at any allocation (1.1-1.3 s here once in a while, where the preflight is 0.3 s).
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        with pytest.raises(UserError) as info:
            preflight(c, environ)
        took = time.thread_time() - t0
    finally:
        gc.enable()
    assert took < 1.0
    text = info.value.format()
    assert "distributed variables" in text and "quantization" in text and "batch arithmetic" in text
    ok = preflight(cfg(tmp_path), {})
    assert all(isinstance(x, Check) for x in ok)


def test_checks_without_config_and_report():
    res = checks(None, NONE, {})
    assert {c.status for c in res} <= {"OK", "WARN"}
    rep = doctor.report(NONE, {"CUDA_VISIBLE_DEVICES": "0"})
    assert rep["packages"]["torch"] and rep["launcher"] == "none" and rep["CUDA_VISIBLE_DEVICES"] == "0"


# ---------------------------------------------------------------------------------------------
# CPU threads: the cores a rank may use (affinity, cgroup quota, ranks on the node), and the warning.


def cgroup(tmp_path, v2: str | None = None, v1: tuple[str, str] | None = None):
    """A cgroup folder as the kernel shows one: v2's `cpu.max`, or v1's `cpu/cpu.cfs_*_us`."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    if v2 is not None:
        (root / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (root / "cpu").mkdir()
        (root / "cpu" / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (root / "cpu" / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    return root


def test_cpu_budget_reads_the_quota_and_splits_the_cores_between_ranks(tmp_path, monkeypatch):
    """The budget on a 64-core machine (a fixed affinity mask): a cgroup quota caps it (v2 and v1,
    rounded down, at least 1; `max` and -1 mean none), the node's ranks share it, and
    OMP_NUM_THREADS, where set, wins. Hand-computed expectations."""
    from scaletune.env import cpu_budget

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    unlimited = cgroup(tmp_path / "a", v2="max 100000")
    assert cpu_budget(1, {}, cgroup_root=unlimited).threads == 64
    assert cpu_budget(4, {}, cgroup_root=unlimited).threads == 16
    two_and_a_half = cgroup(tmp_path / "b", v2="250000 100000")
    b = cpu_budget(1, {}, cgroup_root=two_and_a_half)
    assert (b.quota, b.cores, b.threads) == (2.5, 2, 2)
    assert cpu_budget(4, {}, cgroup_root=two_and_a_half).threads == 1  # 2 cores, 4 ranks: 1 each, at least
    assert cpu_budget(1, {}, cgroup_root=cgroup(tmp_path / "c", v1=("300000", "100000"))).cores == 3
    assert cpu_budget(1, {}, cgroup_root=cgroup(tmp_path / "d", v1=("-1", "100000"))).quota is None
    assert cpu_budget(1, {}, cgroup_root=cgroup(tmp_path / "e", v2="50000 100000")).cores == 1  # half a core
    assert cpu_budget(1, {}, cgroup_root=tmp_path / "absent").quota is None
    set_by_user = cpu_budget(4, {"OMP_NUM_THREADS": "8"}, cgroup_root=two_and_a_half)
    assert set_by_user.threads == 8 and set_by_user.oversubscribed  # 4 x 8 threads on 2 cores
    assert set_by_user.describe() == ("8 per rank (OMP_NUM_THREADS: affinity 64, CPU quota 2.5; 4 ranks on this node)")
    assert cpu_budget(1, {"OMP_NUM_THREADS": "lots"}, cgroup_root=unlimited).threads == 64  # not a number: ignored


def test_cpu_threads_warns_when_oversubscribed_or_busy(monkeypatch):
    """WARN for threads x ranks above the cores, and for a load average at the cores; OK with the
    choice shown otherwise; nothing to say about GPU ranks. (Through `scaletune doctor`:
    tests/e2e/test_cli_usage.py.)"""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    two_ranks = make_env(2, launcher="torchrun")
    quiet = doctor.check_cpu_threads(two_ranks, None, {}, load=0.5)
    assert quiet.status == "OK" and quiet.message.startswith("2 per rank (4 cores: affinity 4"), quiet
    over = doctor.check_cpu_threads(two_ranks, None, {"OMP_NUM_THREADS": "4"}, load=0.5)
    assert over.status == "WARN" and "2 rank(s) x OMP_NUM_THREADS 4 = 8 threads on 4 cores" in over.message
    assert "set it to 2" in over.fix
    busy = doctor.check_cpu_threads(two_ranks, None, {}, load=4.0)
    assert busy.status == "WARN" and "load average 4.0 on 4 cores" in busy.message, busy
    assert doctor.check_cpu_threads(GPU8, None, {}, load=99.0).status == "OK"

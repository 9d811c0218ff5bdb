"""Property: whatever config text, overrides and data file a user (or an attacker) hands scaletune,
the preflight ends in a resolved run or one UserError (exit 2 at the command line), never another
exception, within a time and memory bound. Hypothesis mutates a real, valid config and data file.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tracemalloc

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletune.config import read_config
from scaletune.env import DistributedEnv
from scaletune.errors import UserError
from tests.helpers import REPO_ROOT, make_config

SNIPPETS = [
    "x: &a [*a]\n", "training:\n  max_steps: 1\n", "evil: !!python/object/apply:os.system ['touch PWNED']\n",
    "a: &b [1,1,1,1,1,1,1,1]\nb: &c [*b,*b,*b,*b,*b,*b,*b,*b]\nc: [*c,*c,*c,*c,*c,*c,*c,*c]\n", "\t- tab\n",
    "seed: 99999999999999999999999999\n", "model: ~\n", "data: [1, 2]\n", "output_dir: \"a\\nb\"\n",
    "learning_rate: .nan\n", "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n", "{",
    "distributed: {strategy: deepspeed, zero_stage: 3, offload_params: true}\n", "stages: [{name: a}, {name: a}]\n",
]  # fmt: skip
KEYS = ["seed", "output_dir", "training.max_steps", "training.learning_rate", "model.dtype", "model.lora", "data.max_seq_length",
        "data.packing", "distributed.strategy", "distributed.num_processes", "distributed.env", "stages", "bogus.x", "training"]  # fmt: skip
VALUES = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.booleans(), st.none(), st.sampled_from(["[a, b]", "{r: 8}", "&x [*x]", "auto", "'", "\"", "\x00", "1e309"]),
)  # fmt: skip


@st.composite
def config_texts(draw, model_dir: str, out: str) -> bytes:
    cfg = make_config(model_dir, out)
    for _ in range(draw(st.integers(0, 3))):  # typed mutations of the mapping
        section = draw(st.sampled_from(sorted(cfg)))
        if isinstance(cfg[section], dict) and cfg[section] and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(cfg[section])))
            cfg[section][key] = draw(VALUES)
        else:
            cfg[section] = draw(VALUES)
    text = yaml.safe_dump(cfg).encode()
    for _ in range(draw(st.integers(0, 2))):  # textual ones: hostile snippets and raw bytes
        pos = draw(st.integers(0, len(text)))
        piece = draw(st.one_of(st.sampled_from(SNIPPETS).map(str.encode), st.binary(max_size=8)))
        text = text[:pos] + piece + text[pos:]
    return text


def data_file(draw_records: list, junk: bytes) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in draw_records) + junk


RECORDS = st.lists(
    st.one_of(
        st.fixed_dictionaries({"instruction": st.text(max_size=30), "output": st.text(max_size=30)}),
        st.dictionaries(st.sampled_from(["instruction", "input", "output", "x"]), VALUES, max_size=3),
        VALUES,
    ),
    max_size=6,
)


@settings(
    max_examples=40, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_preflight_ends_in_a_run_or_one_user_error(tiny_model_dir, tmp_path, data):
    from scaletune.run import prepare

    out = tmp_path / "run"
    path = tmp_path / "c.yaml"
    path.write_bytes(data.draw(config_texts(str(tiny_model_dir), str(out))))
    overrides = data.draw(
        st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), VALUES.map(str)), max_size=3)
    )
    records = data.draw(RECORDS)
    junk = data.draw(st.binary(max_size=12))
    (tmp_path / "d.jsonl").write_bytes(data_file(records, junk))
    if data.draw(st.booleans()):
        overrides.append(f"data.train={{path: {tmp_path / 'd.jsonl'}, format: alpaca}}")
    tracemalloc.start()
    try:
        prepare(read_config(path, overrides), DistributedEnv("none"), environ={})
    except UserError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 512 * 2**20, f"{peak / 2**20:.0f} MiB for one config"
    assert not (tmp_path / "PWNED").exists() and not out.exists()


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_cli_exits_0_or_2_never_a_traceback(tiny_model_dir, tmp_path, data):
    """The same inputs through `scaletune train --check` in a process of its own, bounded to 6 GiB
    of address space and 120 s."""
    path = tmp_path / "c.yaml"
    path.write_bytes(data.draw(config_texts(str(tiny_model_dir), str(tmp_path / "run"))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "scaletune", "train", str(path), "--check"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path, preexec_fn=_limits)  # fmt: skip
    assert proc.returncode in (0, 2), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "PWNED").exists()

"""scaletune.objectives.precomputed: the shared cache of a first stage's reference table is reused
only by a run that would compute the same numbers (issue 38).

The control is the same config resolved twice: one path. Each setting that changes a reference
log-prob's value (compute dtype, autocast or bf16 copies, the engine, its world size, the attention
kernel, Liger, micro-batch size, the device) must give another path; a table computed one way and read
by a run computing another gives that run a non-zero reward margin at step 0.
"""

from __future__ import annotations

import pytest

from scaletune.objectives.precomputed import cache_path
from scaletune.resolve import decide
from tests.helpers import make_config, make_env

DPO = {"objective": "dpo", "preference": {"reference": "precomputed"}}
FINGERPRINTS = ["train-fingerprint", "eval-fingerprint"]

GPU = {"gpus": 1}
AUTOCAST = {"model": {"dtype": "bfloat16", "mixed_precision": "autocast"}}
# what changes: (the control's config sections and environment, the changed run's). Each must move
# the cache entry; each kept the same entry before issue 38 (which keyed the storage dtype only).
CHANGES = {
    "compute dtype": (({}, {}), ({"model": {"dtype": "bfloat16"}}, {})),
    "bf16 copies instead of autocast": (
        (AUTOCAST, GPU),
        ({"model": {"dtype": "bfloat16", "mixed_precision": "bf16_params"}}, GPU),
    ),
    "engine": (
        ({"distributed": {"strategy": "ddp", "num_processes": 2}}, {"world": 2}),
        ({"distributed": {"strategy": "fsdp", "num_processes": 2}}, {"world": 2}),
    ),
    "world size": (
        ({"distributed": {"strategy": "ddp", "num_processes": 2}}, {"world": 2}),
        ({"distributed": {"strategy": "ddp", "num_processes": 3}}, {"world": 3}),
    ),
    "attention kernel": (({}, {}), ({"model": {"attn_implementation": "eager"}}, {})),
    "Liger": (({}, {}), ({"model": {"liger": True}}, {})),
    "micro-batch size": (({}, {}), ({"training": {"micro_batch_size": 4}}, {})),
    "device type": (({}, {}), ({}, GPU)),
}


def path_of(tmp_path, sections: dict, world: int = 1, gpus: int = 0):
    cfg = make_config("llama-tiny", tmp_path / "run", {"training": DPO}, as_config=True, **sections)
    return cache_path(decide(cfg, make_env(world, gpus=gpus), world_size=world), 0, FINGERPRINTS)


def test_the_same_run_shares_its_table(tmp_path):
    assert path_of(tmp_path, {}) == path_of(tmp_path, {})
    assert path_of(tmp_path, {"training": {"learning_rate": 1e-5}}) == path_of(tmp_path, {})  # the step changes nothing


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_run_computing_otherwise_gets_its_own_table(tmp_path, change):
    (base, base_env), (changed, changed_env) = CHANGES[change]
    assert path_of(tmp_path, changed, **changed_env) != path_of(tmp_path, base, **base_env), change

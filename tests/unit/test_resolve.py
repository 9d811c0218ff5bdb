"""One resolution phase: `auto` decided by the real planner and then checked by the same rules as a
configured strategy, one precision rule read by every layer, one DeepSpeed JSON generator, and a
curriculum stage's `data:` merged onto the top level's."""

from __future__ import annotations

import json
import time

import pytest
import torch

from scaletune.config import load_config, read_config
from scaletune.errors import ConfigError, UserError
from scaletune.plan import choose_auto, plan
from scaletune.resolve import decide, resolve, resolve_stages
from scaletune.strategies import make_strategy
from scaletune.strategies.deepspeed_config import engine_config
from tests.helpers import make_config, make_env


def llama70b_lora(tmp_path, **model):
    """make_config's run of Llama 3 70B (a preset, no weights) with LoRA r=16 in bfloat16 and
    gradient checkpointing (the planner's figures in the docstrings below assume it) on dummy
    rows of 2048 tokens, 32 sequences a step of 1 a rank, no checkpoints, the strategy left to decide."""
    return make_config(
        "llama-3-70b",
        tmp_path / "run",
        as_config=True,
        model={"dtype": "bfloat16", "lora": {"r": 16}, "gradient_checkpointing": True, **model},
        data={"train": None, "dummy": {}, "max_seq_length": 2048},
        training={"global_batch_size": 32, "micro_batch_size": 1, "save_every": 0},
        distributed={"strategy": None, "num_processes": None},
    )


@pytest.mark.parametrize(
    "memory_gib, chosen",
    [(29.5, "deepspeed zero_stage 3"), (11.0, "deepspeed zero_stage 3")],  # 11 GiB: ZeRO-3 with offload
)
def test_auto_chosen_zero3_is_checked_like_a_configured_one(tmp_path, memory_gib, chosen):
    """The planner picks ZeRO-3 for a 70B LoRA on 8 GPUs of this size (fsdp needs 30.8 GiB, ZeRO-3
    28.6; with offload 12.3 and 10.0); `model.compile`, which ZeRO-3 forbids, is then refused by
    the same rule as a configured ZeRO-3, before anything loads or is written (exit 2 at the CLI)."""
    from scaletune.run import prepare

    env = make_env(8, gpus=8, memory_gib=memory_gib)
    plain = resolve(llama70b_lora(tmp_path), env, choose_auto=choose_auto)
    assert plain.strategy_label == chosen and plain.requested == "auto"
    assert plain.offload_params == (memory_gib < 12)
    t0 = time.perf_counter()
    with pytest.raises(UserError) as info:
        prepare(llama70b_lora(tmp_path, compile=True), env, environ={})
    assert time.perf_counter() - t0 < 30  # the preset has no weights: nothing was loaded
    text = info.value.format()
    assert "model.compile cannot run under deepspeed zero_stage 3 (chosen by distributed.strategy auto)" in text
    assert not (tmp_path / "run").exists()


def test_the_doctor_sees_the_auto_choice(tmp_path):
    """The doctor's checks run on the resolved run: 8-bit QLoRA under a sharding strategy the planner
    picked (8-bit 70B on 8 x 29.5 GiB: fsdp) fails there as it does when configured."""
    from scaletune import doctor

    cfg = llama70b_lora(tmp_path, quantization={"bits": 8})
    spec = resolve(cfg, make_env(8, gpus=8, memory_gib=29.5), choose_auto=choose_auto, check=False)
    assert spec.requested == "auto" and spec.shards_params
    quant = doctor.check_quantization(spec.env, spec)[1]
    assert quant.status == "FAIL" and f"cannot be sharded by {spec.strategy_label}" in quant.message


def tiny_cfg(dtype: str, **distributed):
    """make_config's run of Llama 3.2 1B (a preset) in `dtype` on dummy rows of 256 tokens, 8
    sequences a step of 1 a rank, `distributed` over the defaults."""
    return make_config(
        "llama-3.2-1b",
        "runs/x",
        as_config=True,
        model={"dtype": dtype},
        data={"train": None, "dummy": {}, "max_seq_length": 256},
        training={"micro_batch_size": 1},
        distributed={"strategy": None, "num_processes": None, **distributed},
    )


@pytest.mark.parametrize("env, want", [(make_env(), "float32"), (make_env(gpus=1, memory_gib=80), "bfloat16")])
def test_dtype_auto_is_one_precision_everywhere(env, want):
    """`dtype: auto` is decided once: the strategy's compute dtype, DeepSpeed's JSON and the planner's
    bytes all equal those of the same run with the dtype written out."""
    for strategy in ("deepspeed", "fsdp", "ddp"):
        auto = decide(tiny_cfg("auto", strategy=strategy), env)
        explicit = decide(tiny_cfg(want, strategy=strategy), env)
        assert auto.precision == explicit.precision and auto.precision.compute == want
        assert make_strategy(auto).compute_dtype == getattr(torch, want)
        p_auto, p_explicit = plan(auto, gpu_memory_bytes=None), plan(explicit, gpu_memory_bytes=None)
        assert [s.per_rank_bytes for s in p_auto.strategies] == [s.per_rank_bytes for s in p_explicit.strategies]
        if strategy == "deepspeed":
            assert engine_config(auto)["bf16"]["enabled"] is (want == "bfloat16")
            assert engine_config(auto) == engine_config(explicit)


def test_engine_deepspeed_json_equals_config_deepspeed():
    """The engine's DeepSpeed config and `scaletune config deepspeed` given the same settings are
    the same JSON; the only key the CLI adds is the optimizer DeepSpeed must own under offload when
    the HF Trainer drives it (scaletune's engine hands DeepSpeed its own CPU Adam instead). On a
    machine without GPUs the engine steps with torch's AdamW and adds the one key DeepSpeed needs
    to accept it under offload.

    One case: both sides call `deepspeed_json`, so other stages and dtypes would only feed it other
    values; here every setting either side passes on differs from the generator's default (stage 3,
    both offloads, bf16, concrete batch numbers), so a setting one side drops or misnames changes
    one JSON and not the other."""
    from typer.testing import CliRunner

    from scaletune.cli import app

    dist = {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": True, "offload_params": True}
    engine = engine_config(decide(tiny_cfg("bfloat16", **dist), make_env(2, gpus=2)))
    on_cpu = engine_config(decide(tiny_cfg("bfloat16", **dist), make_env(2)))
    assert on_cpu.pop("zero_force_ds_cpu_optimizer") is False and on_cpu == engine
    args = [
        "config",
        "deepspeed",
        "--zero-stage",
        "3",
        "--bf16",
        "--offload-optimizer",
        "--offload-params",
        "--train-batch-size",
        "8",
        "--micro-batch-size",
        "1",
        "--gradient-accumulation-steps",
        "4",
        "--gradient-clipping",
        "1.0",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    cli = json.loads(res.stdout)
    assert cli.pop("optimizer")["type"] == "AdamW" and "optimizer" not in engine
    assert engine == cli


def test_a_stage_that_names_only_its_train_file_inherits_the_rest(tmp_path):
    cfg = load_config(
        None,
        data={
            "model": {"name_or_path": "m"},
            "data": {"train": {"path": "a.json"}, "max_seq_length": 128, "packing": True, "eval_fraction": 0.1},
            "stages": [{"name": "one"}, {"name": "two", "data": {"train": {"path": "b.jsonl", "format": "text"}}}],
        },
    )
    one, two = resolve_stages(cfg)
    assert two.data.train.path == "b.jsonl" and two.data.train.format == "text"
    assert two.data.max_seq_length == 128 and two.data.packing is True and two.data.eval_fraction == 0.1
    assert one.data == cfg.data
    # The position check runs on the merged value: 128 fits a model of 512 positions.
    spec = resolve(cfg, make_env(), max_positions=512)
    assert [s.data.max_seq_length for s in spec.stages] == [128, 128]
    with pytest.raises(
        UserError, match=r"data.max_seq_length \(128\) is larger than the model's max_position_embeddings \(64\)"
    ):
        resolve(cfg, make_env(), max_positions=64)


def test_a_stage_source_replaces_the_top_level_source_of_either_kind():
    cfg = load_config(
        None,
        data={
            "model": {"name_or_path": "m"},
            "data": {"dummy": {"num_samples": 8}, "max_seq_length": 64},
            "stages": [{"name": "real", "data": {"train": {"path": "a.json"}}}],
        },
    )
    (stage,) = resolve_stages(cfg)
    assert stage.data.dummy is None and stage.data.train.path == "a.json" and stage.data.max_seq_length == 64


def _config_problem(tmp_path, overrides: list[str]) -> str:
    """The one problem `resolve` finds in a small config with `overrides`, without its file:line."""
    path = tmp_path / "c.yaml"
    path.write_text("model: {name_or_path: some/model}\ndata: {dummy: {}}\n")
    with pytest.raises(ConfigError) as info:
        resolve(read_config(path, overrides), make_env())
    [problem] = info.value.problems
    return problem.split(": ", 1)[1]


def test_quantization_needs_lora_is_one_rule(tmp_path, monkeypatch):
    """`scaletune.hf` refuses quantization without LoRA with the config rule's own words (its
    arguments are named without the `model.` prefix)."""
    from scaletune import hf

    monkeypatch.setattr(hf.DistributedEnv, "from_environ", staticmethod(lambda *a, **k: make_env()))
    config = _config_problem(tmp_path, ["model.quantization={bits: 4}"])
    with pytest.raises(UserError) as info:
        hf.load_model_for_training(tmp_path, quantization={"bits": 4})
    assert info.value.problems == [config.replace("model.", "")]


def test_liger_under_zero3_is_one_rule(tmp_path):
    """The loss refuses Liger on a ZeRO-3-partitioned head with the config rule's own words."""
    from scaletune.models.loss import liger_head_cross_entropy

    config = _config_problem(
        tmp_path, ["model.liger=true", "distributed.strategy=deepspeed", "distributed.zero_stage=3"]
    )
    head = torch.nn.Linear(4, 8)
    with pytest.raises(RuntimeError) as info:
        liger_head_cross_entropy(torch.zeros(1, 4), head, torch.zeros(1, dtype=torch.long), partitioned=True)
    assert str(info.value) == config

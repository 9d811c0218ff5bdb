"""Config: YAML + overrides, unknown keys, every problem at once with file:line, derived numbers."""

from __future__ import annotations

import textwrap
import typing
from pathlib import Path

import pytest
import yaml

import scaletune
from scaletune.config import (
    Config,
    DataConfig,
    StageData,
    StageTraining,
    TrainingConfig,
    dump_config,
    load_config,
    parse_override,
    read_config,
)
from scaletune.env import DistributedEnv
from scaletune.errors import ConfigError
from scaletune.resolve import decide, resolve, resolve_stages, steps_for

BASE = """\
output_dir: runs/x
model:
  name_or_path: some/model
data:
  train: {path: data.json, format: alpaca}
"""


def write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def problems_of(tmp_path, text, overrides=()):
    """Every schema and cross-field problem of a config resolved for one CPU process."""
    with pytest.raises(ConfigError) as info:
        resolve(read_config(write(tmp_path, text), list(overrides)), DistributedEnv("none"))
    return info.value.problems


def resolved(tmp_path, text, overrides=()):
    return resolve(read_config(write(tmp_path, text), list(overrides)), DistributedEnv("none")).config


def test_defaults_fill_in(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.training.global_batch_size == 32
    assert cfg.training.micro_batch_size == 4
    assert cfg.distributed.strategy == "auto"
    assert cfg.distributed.zero_stage == 2
    assert cfg.model.trust_remote_code is False
    assert cfg.model.device_map is None
    assert cfg.logging.tensorboard is True


def test_dotted_overrides_are_parsed_as_yaml(tmp_path):
    cfg = load_config(
        write(tmp_path, BASE),
        ["training.learning_rate=1e-4", "model.lora={r: 8}", "data.packing=true", "distributed.num_processes=2"],
    )
    assert cfg.training.learning_rate == pytest.approx(1e-4)
    assert cfg.model.lora is not None and cfg.model.lora.r == 8 and cfg.model.lora.target_modules == "auto"
    assert cfg.data.packing is True
    assert cfg.distributed.num_processes == 2


def test_unknown_key_names_line_key_and_allowed(tmp_path):
    probs = problems_of(tmp_path, BASE + "training:\n  learnig_rate: 0.1\n")
    assert len(probs) == 1
    p = probs[0]
    assert "c.yaml:7" in p
    assert "training.learnig_rate" in p
    assert "did you mean 'learning_rate'" in p
    assert "global_batch_size" in p  # the allowed keys are listed
    # A nested section's unknown key is named by its dotted path, with that section's allowed keys.
    nested = BASE.replace("  name_or_path: some/model\n", "  name_or_path: some/model\n  lora: {rank: 4}\n")
    [p] = problems_of(tmp_path, nested)
    assert p.startswith(f"{tmp_path / 'c.yaml'}:4: model.lora.rank: unknown key; allowed here: r, alpha"), p


def test_every_problem_reported_at_once(tmp_path):
    text = BASE + textwrap.dedent(
        """\
        training:
          global_batch_size: 10
          micro_batch_size: 4
          warmup_steps: -1
        distributed:
          strategy: ddp
          offload_optimizer: true
          zero_stage: 5
        bogus: 1
        """
    )
    probs = problems_of(tmp_path, text, ["training.epochs=zero", "notakeyvalue"])
    joined = "\n".join(probs)
    assert "training.warmup_steps" in joined and "c.yaml:9" in joined
    assert "distributed.zero_stage" in joined
    assert "bogus" in joined
    assert "command line: training.epochs" in joined
    assert "notakeyvalue" in joined
    assert "has no offload" in joined
    # The batch-divisibility check of a section with another invalid key is reported too.
    assert "must be a multiple of micro_batch_size" in joined
    assert len(probs) == 7


def test_missing_required_keys(tmp_path):
    probs = problems_of(tmp_path, "output_dir: x\n")
    assert any(p.endswith("model: required key is missing") for p in probs)
    assert any(p.endswith("data: required key is missing") for p in probs)


def test_bad_yaml_names_line(tmp_path):
    probs = problems_of(tmp_path, "model:\n  name_or_path: [unclosed\n")
    assert len(probs) == 1 and "c.yaml:" in probs[0] and "not valid YAML" in probs[0]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_data_needs_a_source(tmp_path):
    probs = problems_of(tmp_path, "model: {name_or_path: m}\ndata: {max_seq_length: 64}\n")
    assert any("data.train" in p and "data.dummy" in p for p in probs)


def test_offload_and_quantization_cross_checks(tmp_path):
    probs = problems_of(
        tmp_path,
        BASE
        + "distributed: {strategy: deepspeed, zero_stage: 2, offload_params: true}\n"
        + "stages: [{name: a}, {name: a}]\n",
        ["model.quantization={bits: 4}"],
    )
    joined = "\n".join(probs)
    assert "offload_params needs zero_stage 3" in joined
    assert "quantization" in joined and "model.lora" in joined
    assert "repeated: a" in joined


@pytest.mark.parametrize("world,gas", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_decide_splits_the_global_batch(tmp_path, world, gas):
    """What the run uses: `decide`'s batch arithmetic, 32 = 4 x world x gas (gas counted by hand)."""
    cfg = load_config(write(tmp_path, BASE + "training: {global_batch_size: 32, micro_batch_size: 4}\n"))
    b = decide(cfg, DistributedEnv("none"), world_size=world).batch
    assert (b.micro_batch_size, b.world_size, b.gradient_accumulation_steps) == (4, world, gas)
    assert b.max_tokens_per_step == 32 * cfg.data.max_seq_length
    assert f"world_size {world}" in b.describe()


def test_indivisible_global_batch_is_a_located_error(tmp_path):
    """32 sequences cannot split over 3 ranks of 4: `resolve` names the line of global_batch_size."""
    text = BASE + "training:\n  micro_batch_size: 4\n  global_batch_size: 32\n"
    with pytest.raises(ConfigError) as info:
        resolve(read_config(write(tmp_path, text)), DistributedEnv("none"), world_size=3)
    [msg] = info.value.problems
    line = text.splitlines().index("  global_batch_size: 32") + 1
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:{line}: training.global_batch_size (32)"), msg
    assert "4 x 3 = 12" in msg and "24 or 36" in msg
    # The parent that starts the ranks (one process, no launcher) checks for distributed.num_processes.
    text = BASE + "training: {global_batch_size: 6, micro_batch_size: 2}\n"
    text += "distributed: {strategy: ddp, num_processes: 2}\n"
    [msg] = problems_of(tmp_path, text)
    assert "training.global_batch_size (6) must be a multiple of micro_batch_size x world_size (2 x 2 = 4)" in msg


def test_resolved_config_round_trips_and_redacts_secrets(tmp_path):
    cfg = load_config(
        write(tmp_path, BASE),
        ["distributed.env={HF_TOKEN: hf_secret123, NCCL_DEBUG: INFO, WANDB_API_KEY: abc}"],
    )
    text = dump_config(cfg)
    assert "hf_secret123" not in text and "abc" not in text.split("WANDB_API_KEY")[1].split("\n")[0]
    assert "NCCL_DEBUG: INFO" in text
    data = yaml.safe_load(text)
    data["distributed"]["env"] = {"NCCL_DEBUG": "INFO"}
    again = Config.model_validate(data)
    assert again.training == cfg.training and again.model == cfg.model


def test_mlflow_tracking_uri_refuses_a_password_in_the_url(tmp_path):
    """A tracking URI with `user:password@` would be written to config.yaml: refused, naming
    MLflow's variables; a plain server URL, a database path and a user without password load."""
    found = problems_of(tmp_path, BASE, ["logging.mlflow={tracking_uri: 'https://bob:pw123@mlflow.example:5000'}"])
    text = " ".join(map(str, found))
    assert "logging.mlflow.tracking_uri" in text and "MLFLOW_TRACKING_PASSWORD" in text, text
    for uri in ("http://mlflow.example:5000", "sqlite:////tmp/x/mlflow.db", "https://bob@mlflow.example", "databricks"):
        cfg = load_config(write(tmp_path, BASE), [f"logging.mlflow={{tracking_uri: '{uri}', tags: {{team: nlp}}}}"])
        assert cfg.logging.mlflow is not None and cfg.logging.mlflow.tracking_uri == uri
    assert load_config(write(tmp_path, BASE)).logging.mlflow is None


def test_a_template_is_shown_only_where_it_applies(tmp_path):
    """Issue 40, item 10: `config show` (and the run's config.yaml) said `template: alpaca` under
    `format: messages`, a key that format ignores. It is shown for alpaca sources only, and the
    dumped config still loads as the same config."""
    (tmp_path / "m.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    cfg = load_config(
        write(tmp_path, BASE),
        [
            f"data.train={{path: {tmp_path / 'm.jsonl'}, format: messages}}",
            f"data.eval={{path: {tmp_path / 'e.json'}}}",
        ],
    )
    data = yaml.safe_load(dump_config(cfg))["data"]
    assert data["train"]["format"] == "messages" and "template" not in data["train"], data["train"]
    assert data["eval"]["format"] == "alpaca" and data["eval"]["template"] == "alpaca", data["eval"]
    assert Config.model_validate(yaml.safe_load(dump_config(cfg))).data == cfg.data


def test_override_syntax():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=x=y") == (["a"], "x=y")
    with pytest.raises(ValueError):
        parse_override("novalue")
    with pytest.raises(ValueError):
        parse_override("a..b=1")


def test_implicit_single_stage_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    stages = resolve_stages(cfg)
    assert [s.name for s in stages] == ["main"]
    # Everything as given, but `preference.reference: auto` decided (no LoRA here: precomputed).
    assert cfg.training.preference.reference == "auto" and stages[0].training.preference.reference == "precomputed"
    assert stages[0].training.model_dump(exclude={"preference"}) == cfg.training.model_dump(exclude={"preference"})
    cfg = load_config(
        write(
            tmp_path,
            BASE
            + "training: {max_steps: 10, learning_rate: 0.1}\n"
            + "stages:\n  - {name: one}\n  - {name: two, training: {epochs: 2, learning_rate: 0.01}}\n",
        )
    )
    one, two = resolve_stages(cfg)
    assert one.training.max_steps == 10 and one.training.learning_rate == 0.1
    # A stage that sets epochs and not max_steps runs by epochs.
    assert two.training.max_steps is None and two.training.epochs == 2 and two.training.learning_rate == 0.01


def test_steps_for(tmp_path):
    cfg = load_config(write(tmp_path, BASE + "training: {epochs: 1.5}\n"))
    assert steps_for(10, cfg.training) == 15
    cfg = load_config(write(tmp_path, BASE + "training: {epochs: 3, max_steps: 4}\n"))
    assert steps_for(10, cfg.training) == 4


def test_quantization_with_sharded_strategies(tmp_path):
    lora = "model.lora={r: 8}"
    zero3 = BASE + "distributed: {strategy: deepspeed, zero_stage: 3}\n"
    probs = problems_of(tmp_path, zero3, [lora, "model.quantization={bits: 4}"])
    assert any("storage_dtype: bfloat16" in p and "zero_stage 3" in p for p in probs)
    probs = problems_of(tmp_path, zero3, [lora, "model.quantization={bits: 8}"])
    assert any("bits 8 cannot be sharded by deepspeed zero_stage 3" in p for p in probs)
    ok = resolved(tmp_path, zero3, [lora, "model.quantization={bits: 4, storage_dtype: bfloat16}"])
    assert ok.model.quantization.storage_dtype == "bfloat16"
    # FSDP cannot shard a quantized model at all (issue 16), whatever the storage dtype.
    for q in ("{bits: 4}", "{bits: 4, storage_dtype: bfloat16}"):
        probs = problems_of(tmp_path, BASE + "distributed: {strategy: fsdp}\n", [lora, f"model.quantization={q}"])
        assert any("cannot run under strategy fsdp" in p and "use strategy ddp" in p for p in probs), probs
    resolved(tmp_path, BASE + "distributed: {strategy: ddp}\n", [lora, "model.quantization={bits: 8}"])


def test_activation_offload_and_liger_keys(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.model.activation_offload is False and cfg.model.liger is False
    dumped = yaml.safe_load(dump_config(cfg))["model"]
    assert dumped["activation_offload"] is False and dumped["liger"] is False
    cfg = load_config(write(tmp_path, BASE), ["model.activation_offload=true", "model.liger=true"])
    assert cfg.model.activation_offload is True and cfg.model.liger is True
    probs = problems_of(tmp_path, BASE, ["model.liger=maybe"])
    assert any("model.liger" in p for p in probs)


def test_liger_is_rejected_under_zero3(tmp_path):
    liger = BASE.replace("  name_or_path: some/model\n", "  name_or_path: some/model\n  liger: true\n")
    text = liger + "distributed: {strategy: deepspeed, zero_stage: 3}\n"
    probs = problems_of(tmp_path, text)
    assert len(probs) == 1
    assert "model.liger cannot run under deepspeed zero_stage 3" in probs[0]
    assert "lm_head.weight outside lm_head's forward" in probs[0] and "partitioned" in probs[0]
    # the same from the command line, and not for the strategies where the head's weight is whole
    assert problems_of(
        tmp_path, BASE, ["model.liger=true", "distributed.strategy=deepspeed", "distributed.zero_stage=3"]
    )
    for dist in ("{strategy: deepspeed, zero_stage: 2}", "{strategy: fsdp}", "{strategy: ddp}"):
        assert resolved(tmp_path, liger + f"distributed: {dist}\n").model.liger
    resolved(tmp_path, BASE + "distributed: {strategy: deepspeed, zero_stage: 3}\n")


def test_compile_is_off_by_default_and_rejected_under_zero3(tmp_path):
    assert load_config(write(tmp_path, BASE)).model.compile is False
    assert load_config(write(tmp_path, BASE), ["model.compile=true"]).model.compile is True
    probs = problems_of(
        tmp_path, BASE, ["model.compile=true", "distributed.strategy=deepspeed", "distributed.zero_stage=3"]
    )
    assert len(probs) == 1 and "model.compile cannot run under deepspeed zero_stage 3" in probs[0]
    for dist in ("{strategy: deepspeed, zero_stage: 2}", "{strategy: fsdp}", "{strategy: ddp}"):
        assert resolved(tmp_path, BASE + f"distributed: {dist}\n", ["model.compile=true"]).model.compile


@pytest.mark.parametrize(("stage_model", "main"), [(StageData, DataConfig), (StageTraining, TrainingConfig)])
def test_stage_models_are_the_main_models_made_optional(stage_model, main):
    """A stage's fields are a subset of the main section's, each with the same type, constraints
    and description, optional with default None (not given: inherited)."""
    assert stage_model.model_fields.keys() <= main.model_fields.keys()
    for name, info in stage_model.model_fields.items():
        ref = main.model_fields[name]
        assert info.default is None and not info.is_required(), name
        assert info.description == ref.description, name
        args = [a for a in typing.get_args(info.annotation) if a is not type(None)]
        assert type(None) in typing.get_args(info.annotation) and args, name
        inner, metadata = args[0], []
        if typing.get_origin(inner) is typing.Annotated:
            inner, *metadata = typing.get_args(inner)
        assert metadata == ref.metadata, name
        # `X | None` of a field that already allows null is that field's own annotation.
        own = inner if len(args) == 1 else info.annotation
        assert typing.Optional[own] == typing.Optional[ref.annotation], name  # noqa: UP045


def test_a_stage_key_is_refused_as_the_top_level_key_is(tmp_path):
    """The constraint of `data.max_seq_length` (>= 8) holds in a stage too; not giving it inherits."""
    text = BASE + "stages:\n  - {name: a, data: {max_seq_length: 4}, training: {epochs: 0}}\n  - {name: b}\n"
    probs = "\n".join(problems_of(tmp_path, text))
    assert "stages.0.data.max_seq_length: Input should be greater than or equal to 8" in probs
    assert "stages.0.training.epochs: Input should be greater than 0" in probs
    assert "stages.1" not in probs


def test_one_pydantic_error_formatter():
    """pydantic's errors are turned into text in config/loader.py only (`error_messages` for the
    library's arguments, LoRA mappings and progress.json; located lines for config files)."""
    src = Path(scaletune.__file__).parent
    readers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if ".errors()" in p.read_text())
    assert readers == ["config/loader.py"]


def test_error_messages_name_the_key_without_pydantics_prefix(tmp_path):
    """The same problem reads the same in a config file and in `scaletune.hf`'s arguments."""
    from pydantic import ValidationError

    from scaletune.config import ModelConfig, error_messages

    [located] = problems_of(tmp_path, BASE, ["model.device_map=everywhere"])
    with pytest.raises(ValidationError) as info:
        ModelConfig(name_or_path="x", device_map="everywhere")
    [text] = error_messages(info.value, "model")
    assert located.endswith(f": {text}") and "Value error" not in text

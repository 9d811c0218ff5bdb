"""Your own model and data: references imported and checked, the forward's contract, initial
weights and the export round trip, per-stage freezing patterns, and the config rules."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from scaletune.config import Config, ModelConfig
from scaletune.config.user_code import call_checked, import_callable
from scaletune.env import DistributedEnv
from scaletune.errors import UserError
from scaletune.models.custom import CustomModelLoss, check_output
from scaletune.models.factory import (
    build_model,
    check_built,
    checkpoint_blocks,
    load_custom_model,
    shard_classes,
    write_export,
)
from scaletune.resolve import Stage, decide, rule_problems
from scaletune.trainer.freezing import apply_trainable, checkpointed_frozen, peak_stage, trainable_sets
from tests.custom_factories import TinyRegressor

REF = "tests.custom_factories:build_tiny"


def problems_of(exc_info) -> str:
    return "\n".join(exc_info.value.problems)


def test_import_callable_reports_each_failure_with_its_key(tmp_path):
    assert import_callable(REF, "model.factory") is sys.modules["tests.custom_factories"].build_tiny
    broken = tmp_path / "broken.py"
    broken.write_text("import nowhere_to_be_found\n")
    cases = {
        "no_colon_here": "expected 'package.module:callable'",
        "tests.no_such_module:build": "does not import: ModuleNotFoundError",
        f"{broken}:build": "does not import: ModuleNotFoundError: No module named 'nowhere_to_be_found'",
        "tests.custom_factories:missing": "has no attribute 'missing'",
        "tests.custom_factories:REF_NOT_THERE": "has no attribute",
        f"{tmp_path / 'absent.py'}:build": "no such file",
    }
    for ref, message in cases.items():
        with pytest.raises(UserError) as exc:
            import_callable(ref, "model.factory")
        assert "model.factory" in str(exc.value) and message in str(exc.value), (ref, str(exc.value))


def test_import_callable_from_a_file_and_not_callable(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("VALUE = 3\ndef build():\n    return VALUE\n")
    assert import_callable(f"{f}:build", "data.factory")() == 3
    with pytest.raises(UserError, match="VALUE is a int, not a callable"):
        import_callable(f"{f}:VALUE", "data.factory")


def test_call_checked_tells_wrong_keywords_from_errors_inside():
    fn = import_callable(REF, "model.factory")
    assert isinstance(call_checked(fn, {"width": 4}, "model.factory", REF), TinyRegressor)
    with pytest.raises(UserError, match=r"cannot be called with \['depth'\]"):
        call_checked(fn, {"depth": 3}, "model.factory", REF)

    def raises_inside(width):
        raise TypeError("a bug in the factory")

    with pytest.raises(TypeError, match="a bug in the factory"):  # not bad input: the traceback shows it
        call_checked(raises_inside, {"width": 1}, "model.factory", "x:y")


def test_check_built_and_check_output_name_the_contract():
    module = TinyRegressor()
    assert check_built(module, REF) == (module, None)
    assert check_built((module, "tok"), REF) == (module, "tok")
    with pytest.raises(UserError, match="returned dict; it must return a torch.nn.Module"):
        check_built({"a": 1}, REF)
    with pytest.raises(UserError, match="returned a tuple of int, int"):
        check_built((1, 2), REF)
    loss = torch.tensor(2.0)
    assert check_output((loss, 3), REF)[1] == 3
    for bad, message in [
        (None, "returned None, not (loss_sum, num_units): it returned no loss"),
        (torch.ones(3), "returned Tensor, not (loss_sum, num_units)"),
        ((torch.ones(3), 3), "a tensor of shape [3] as its loss"),
        ((torch.tensor(3), 3), "as its loss"),  # an integer tensor
        ((loss, "3"), "returned str as num_units"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            check_output(bad, REF)


def test_loss_module_checks_the_returned_count():
    cfg = ModelConfig(factory=REF)
    loss = CustomModelLoss(TinyRegressor(), cfg, shard_classes(TinyRegressor()))
    x, y = torch.randn(5, 4), torch.randn(5)
    out = loss(x=x, y=y)
    assert out.dim() == 0 and loss.returned_units == 5
    loss.check_units(5)
    with pytest.raises(UserError, match="returned num_units 5 for a micro-batch in which the loop counts 4"):
        loss.check_units(4)
    assert loss._no_split_modules == ["Block"]  # the largest ModuleList's class


def test_shard_modules_names_must_exist():
    model = TinyRegressor()
    assert [c.__name__ for c in shard_classes(model, ["Linear"])] == ["Linear"]
    with pytest.raises(UserError, match="model.shard_modules: Nope not in the factory's module"):
        shard_classes(model, ["Nope"])


def test_checkpointed_blocks_give_the_same_gradients():
    """Against a control: the same module without checkpointing, same weights and input."""
    torch.manual_seed(0)
    plain = TinyRegressor(blocks=3)
    ckpt = TinyRegressor(blocks=3)
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(ckpt, (type(ckpt.blocks[0]),)) == 3
    x, y = torch.randn(6, 4), torch.randn(6)
    for m in (plain, ckpt):
        m(x, y)[0].backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name


def test_initial_weights_and_export_round_trip(tmp_path):
    cfg = ModelConfig(factory=REF, factory_kwargs={"width": 6})
    torch.manual_seed(1)
    trained, _ = build_model(cfg)
    write_export(tmp_path / "final", trained.state_dict(), cfg)
    torch.manual_seed(2)  # another initialisation: the weights must come from the file
    again, _ = build_model(cfg.model_copy(update={"name_or_path": str(tmp_path / "final")}))
    for (name, a), b in zip(trained.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    loaded, _ = load_custom_model(tmp_path / "final", REF)
    assert torch.equal(loaded.head.weight, trained.head.weight)
    with pytest.raises(UserError, match="was written by factory"):
        load_custom_model(tmp_path / "final", "tests.custom_factories:build_no_loss")
    # A file of another module: every unknown name is reported, nothing is half-loaded silently.
    other = ModelConfig(factory=REF, factory_kwargs={"width": 5}, name_or_path=str(tmp_path / "final"))
    with pytest.raises(UserError, match="shapes differ"):
        build_model(other)
    torch.save({}, tmp_path / "weights.bin")
    with pytest.raises(UserError, match="found none"):
        build_model(cfg.model_copy(update={"name_or_path": str(tmp_path / "weights.bin")}))


def stage(index, trainable=None, frozen=None) -> Stage:
    base = Config.model_validate({"model": {"factory": REF}, "data": {"factory": "tests.custom_factories:build_data"}})
    t = tuple(trainable) if trainable else None
    f = tuple(frozen) if frozen else None
    return Stage(index, f"s{index}", base.data, base.training, False, t, f)


def test_stage_patterns_become_trainable_sets():
    model = TinyRegressor(blocks=2)
    stages = [stage(0, ["head.*"]), stage(1, ["head.*", "blocks.*"]), stage(2, frozen=["inp.*"]), stage(3)]
    sets = trainable_sets(model, stages, prefix="model.")
    assert sets[0] == {"model.head.weight", "model.head.bias"}
    assert sets[1] == sets[0] | {f"model.blocks.{i}.fc.{k}" for i in range(2) for k in ("weight", "bias")}
    assert sets[2] == sets[1] and sets[3] == sets[1] | {"model.inp.weight", "model.inp.bias"}
    assert peak_stage(sets, model, prefix="model.") == 3
    assert checkpointed_frozen([sets[3], sets[0]], 1) == sets[3] - sets[0]
    assert trainable_sets(model, [stage(0), stage(1)]) == []  # no patterns: nothing changes
    trainable, total = apply_trainable(model, frozenset({"head.weight"}))
    assert trainable == 8 and total == sum(p.numel() for p in model.parameters())
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["head.weight"]


def test_stage_patterns_that_match_nothing_are_all_reported():
    with pytest.raises(UserError) as exc:
        trainable_sets(TinyRegressor(), [stage(0, ["projector.*"]), stage(1, frozen=["*"]), stage(2, ["hed.*"])])
    text = problems_of(exc)
    assert "stages.0.trainable: 'projector.*' matches no parameter" in text
    assert "stages.1 (s1): trainable / frozen leave no parameter to train" in text
    assert "stages.2.trainable: 'hed.*' matches no parameter" in text
    assert "named like: inp.weight" in text


def test_tied_tensor_trains_if_any_of_its_names_does():
    model = TinyRegressor()
    model.tail = torch.nn.Linear(8, 1)
    model.tail.weight = model.head.weight  # tied
    apply_trainable(model, frozenset({"tail.weight"}))
    assert model.head.weight.requires_grad and not model.head.bias.requires_grad


def test_a_frozen_pattern_freezes_a_tied_tensor_under_either_name():
    """`frozen: [head.*]` on a head tied to `tail`: the tensor is frozen under both names (the
    tied name kept it training before); `trainable: [tail.*]` trains it under both."""
    model = TinyRegressor()
    model.tail = torch.nn.Linear(8, 1)
    model.tail.weight = model.head.weight  # tied
    frozen, chosen = trainable_sets(model, [stage(0, frozen=["head.*"]), stage(1, ["tail.*"])])
    assert "head.weight" not in frozen and "tail.weight" not in frozen and "tail.bias" in frozen
    assert {"head.weight", "tail.weight", "tail.bias"} <= chosen and "head.bias" not in chosen
    apply_trainable(model, frozen)
    assert not model.head.weight.requires_grad and model.tail.bias.requires_grad


def rules_for(model: dict, data: dict | None = None, stages: list | None = None) -> list[str]:
    cfg = Config.model_validate(
        {"model": model, "data": data or {"factory": "tests.custom_factories:build_data"}, "stages": stages or []}
    )
    return [p.message for p in rule_problems(decide(cfg, DistributedEnv("none"), world_size=1))]


def test_rules_for_factories():
    assert rules_for({"factory": REF}) == []
    got = rules_for(
        {"factory": REF, "lora": {"r": 4}, "device_map": "cpu", "liger": True},
        {"factory": "x:y", "packing": True, "eval": {"path": "e.json"}},
    )
    assert any("model.lora cannot be used with model.factory" in p for p in got)
    assert any("model.device_map cannot be used with model.factory" in p for p in got)
    assert any("model.liger cannot be used with model.factory" in p for p in got)
    assert any("data.packing applies to text data" in p for p in got)
    assert any("data.eval and data.factory both give data" in p for p in got)
    got = rules_for(
        {"name_or_path": "m", "shard_modules": ["Block"]}, {"train": {"path": "t.json"}, "factory_kwargs": {"a": 1}}
    )
    assert any("model.shard_modules is given without model.factory" in p for p in got)
    assert any("data.factory_kwargs is given without a data factory" in p for p in got)


def test_a_stage_source_replaces_the_top_levels_of_any_kind():
    cfg = Config.model_validate(
        {
            "model": {"factory": REF},
            "data": {"train": {"path": "t.json"}},
            "stages": [{"name": "a"}, {"name": "b", "data": {"factory": "x:y", "factory_kwargs": {"n": 3}}}],
        }
    )
    a, b = decide(cfg, DistributedEnv("none"), world_size=1).stages
    assert a.data.train is not None and a.data.factory is None
    assert b.data.train is None and b.data.factory == "x:y" and b.data.factory_kwargs == {"n": 3}
    with pytest.raises(ValueError, match="give model.name_or_path"):
        ModelConfig()

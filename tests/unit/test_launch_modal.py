"""The Modal app builder: the written app imports with `modal` installed (no network, no deploy)
and declares the requested GPU type and count, volume and secrets."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import yaml

from scaletune.errors import UserError
from scaletune.launch.modal_app import ModalOptions, ModalPlan, plan_inputs, render_modal_app

CONFIG = {
    "output_dir": "runs/demo",
    "model": {"name_or_path": "models/tiny", "tokenizer": None},
    "data": {"train": {"path": "data/train.json", "format": "alpaca"}, "eval": None},
    "distributed": {"env": {"HF_TOKEN": "hf_secret", "NCCL_DEBUG": "WARN"}},
    "stages": [{"name": "s2", "data": {"train": {"path": "data/more.json"}}}],
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text("[]")
    (tmp_path / "data" / "more.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def import_app(path: Path):
    spec = importlib.util.spec_from_file_location(f"scaletune_modal_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec.loader.exec_module(module)
    return module


def test_plan_localizes_files_and_drops_secrets(workdir):
    plan = plan_inputs(CONFIG, workdir)
    assert plan.config["model"]["name_or_path"] == "/root/scaletune-inputs/0-tiny"
    assert plan.config["data"]["train"]["path"] == "/root/scaletune-inputs/1-train.json"
    assert plan.config["stages"][0]["data"]["train"]["path"] == "/root/scaletune-inputs/2-more.json"
    assert plan.config["output_dir"] == "/runs/demo"
    assert plan.config["distributed"]["env"] == {"NCCL_DEBUG": "WARN"}
    assert plan.secret_env_names == ["HF_TOKEN"]
    assert plan.mounts[str(workdir / "models" / "tiny")] == "/root/scaletune-inputs/0-tiny"
    assert CONFIG["distributed"]["env"]["HF_TOKEN"] == "hf_secret"  # input untouched


def test_hub_ids_stay(workdir):
    cfg = dict(CONFIG, model={"name_or_path": "allenai/OLMo-2-0425-1B"})
    assert plan_inputs(cfg, workdir).config["model"]["name_or_path"] == "allenai/OLMo-2-0425-1B"


@pytest.mark.parametrize("count, gpu, torchrun", [(8, "h100", True), (1, "A100-80GB", False)])
def test_written_app_imports_and_declares_gpus(workdir, count, gpu, torchrun):
    pytest.importorskip("modal")
    plan = plan_inputs(CONFIG, workdir)
    opts = ModalOptions(
        gpu_count=count, gpu_type=gpu, app_name="st-test", secrets=("huggingface",), requirements=("torch>=2.6",)
    )
    text = render_modal_app(opts, plan, local_dirs=frozenset({str(workdir / "models" / "tiny")}))
    assert "hf_secret" not in text
    path = workdir / f"app_{count}.py"
    path.write_text(text)
    m = import_app(path)
    expected = f"{gpu.upper()}:{count}"
    assert m.GPU == expected and m.GPU_COUNT == count
    spec = m.train._spec_  # the Modal SDK's record of the function's resources
    assert spec.gpus == expected
    assert list(spec.volumes) == ["/runs"]
    assert "huggingface" in repr(spec.secrets)
    assert m.app.name == "st-test"
    assert (m.COMMAND[:3] == ["python", "-m", "torch.distributed.run"]) == torchrun
    if torchrun:
        assert m.COMMAND[m.COMMAND.index("--nproc-per-node") + 1] == str(count)
    assert m.COMMAND[-3:] == ["scaletune", "train", "/root/scaletune-run/config.yaml"]
    cfg = yaml.safe_load(m.CONFIG_YAML)
    assert cfg["output_dir"] == "/runs/demo" and "HF_TOKEN" not in cfg["distributed"]["env"]
    assert "add_local_dir(" in text and "add_local_file(" in text
    assert 'add_local_python_source("scaletune", ignore=' in text  # assets too, not only .py files


def test_hostile_strings_are_python_literals(workdir):
    cfg = dict(CONFIG, output_dir="runs/x\"'); import os; os.system('id') #")
    plan = plan_inputs(cfg, workdir)
    text = render_modal_app(ModalOptions(gpu_count=2, gpu_type="L40S"), plan)
    compile(text, "app.py", "exec")
    assert "\nimport os" not in text


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(gpu_count=0), "--gpu-count must be 1..8"),
        (dict(gpu_count=9), "--gpu-count must be 1..8"),
        (dict(gpu_type="RTX4090"), "not a Modal GPU type"),
        (dict(secrets=("bad name",)), "--secret"),
        (dict(timeout_hours=30), "--timeout-hours"),
        (dict(env_presets=("nope",)), "unknown env preset"),
    ],
)
def test_bad_input(kw, message):
    base = dict(gpu_count=1, gpu_type="H100")
    base.update(kw)
    with pytest.raises(UserError) as exc:
        render_modal_app(ModalOptions(**base), ModalPlan(config={"output_dir": "/runs/x"}))
    assert message in exc.value.format()

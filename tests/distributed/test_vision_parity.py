"""A vision-language model (issue 37) trains the same computation on 1, 2 or 3 ranks, under ddp,
fsdp and DeepSpeed ZeRO-3, and resumes on another world size.

Model: the `idefics3-tiny` preset (SigLIP vision tower, pixel-shuffle connector, Llama language
model; tests/conftest.py `tiny_vlm_dir`), full fine-tuning in fp32. Data: 48 training and 16
held-out digits of scikit-learn as PNG files and chat records (examples/vlm-digits/render_digits.py),
rendered by the model's processor. Global batch 12 (micro-batch 2), in three stages named by the
model's parameter groups (`models.vision.parameter_groups`): `projector` (2 steps, only the
connector trains), `language` (1 step, the language model and its head), `all` (1 step); an eval
and a checkpoint at each stage's end (steps 2, 3, 4).

The runs, each compared with `single` (one process, the command line forked) on loss, grad norm and
eval loss (1e-4, relative):

- `ddp-2`: `scaletune train ... distributed.num_processes=2` as a user types it (re-executed under
  torchrun);
- `fsdp-2`, `zero3-2` and `zero2-2` (ZeRO-2 with gradient checkpointing: the vision tower's and
  the language model's layers recomputed in backward): one after another in the ranks of one
  torchrun (tests/distributed/sequential_runs.py; their subject is the engines' arithmetic);
- `fsdp-3`: three ranks, so the 16 held-out records split unevenly (6, 5, 5);
- `resumed-1`: one process resuming `ddp-2`'s checkpoint at step 2: steps 3-4 equal `single`'s
  (1e-5).

What a stage freezes stays bit-identical through it: `scaletune export` of `single`'s checkpoints
against the initial weights. `scaletune eval RUN --data` of the held-out records gives `single`'s last eval loss. `ddp-2`'s final/
holds the processor beside the weights; reloaded with transformers'
`AutoModelForImageTextToText` and `AutoProcessor`, its logits on a held-out record equal `single`'s
final/ (1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import assert_close, digit_chats, metrics, run_cli, train_sequentially

pytestmark = pytest.mark.distributed

REL = 1e-4
RESUMED = 1e-5


def _config(model: Path, data: dict[str, Path], out: Path) -> dict:
    return {
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "data": {
            "train": {"path": str(data["train"]), "format": "messages"},
            "eval": {"path": str(data["eval"]), "format": "messages"},
            "max_seq_length": 64,
        },
        "training": {
            "micro_batch_size": 2,
            "global_batch_size": 12,
            "learning_rate": 1e-3,
            "warmup_steps": 0,
            "eval_every": 0,  # at each stage's end
            "save_every": 0,  # a checkpoint at each stage's end, all three kept
            "keep_last": 3,
        },
        # The curriculum people run on these models: the projector first, then the language model, then all.
        "stages": [
            {"name": "projector", "trainable": ["projector"], "training": {"max_steps": 2}},
            {"name": "language", "trainable": ["language"], "training": {"max_steps": 1}},
            {"name": "all", "training": {"max_steps": 1}},
        ],
        "output_dir": str(out),
    }


def _ok(out) -> str:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stderr


@pytest.fixture(scope="module")
def runs(tiny_vlm_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision-parity")
    data = digit_chats(root / "digits", 48, 16)
    cfg = root / "vision.yaml"
    cfg.write_text(yaml.safe_dump(_config(tiny_vlm_dir, data, root / "single")))
    names = ("single", "ddp-2", "fsdp-2", "zero3-2", "zero2-2", "fsdp-3", "resumed-1")
    out = {name: root / name for name in names}
    _ok(run_cli(["train", str(cfg)]))
    _ok(run_cli(["train", str(cfg), f"output_dir={out['ddp-2']}", "distributed.num_processes=2"]))
    engines = {
        "fsdp-2": ["distributed.strategy=fsdp"],
        "zero3-2": ["distributed.strategy=deepspeed", "distributed.zero_stage=3"],
        "zero2-2": ["distributed.strategy=deepspeed", "distributed.zero_stage=2", "model.gradient_checkpointing=true"],
    }
    world = "distributed.num_processes=2"
    jobs = {name: ["train", str(cfg), f"output_dir={out[name]}", world, *keys] for name, keys in engines.items()}
    said = train_sequentially(jobs, root / "torchrun-2", nproc=2)
    # Every layer recomputes in zero2-2: the vision tower's two and the language model's two.
    assert "gradient checkpointing: 4 layers recompute" in said["zero2-2"], said["zero2-2"][-3000:]
    three = [
        "train",
        str(cfg),
        f"output_dir={out['fsdp-3']}",
        "distributed.num_processes=3",
        "distributed.strategy=fsdp",
    ]
    train_sequentially({"fsdp-3": three}, root / "torchrun-3", nproc=3)
    step2 = out["ddp-2"] / "checkpoints" / "step-2"
    _ok(run_cli(["train", str(cfg), f"output_dir={out['resumed-1']}", f"training.resume={step2}"]))
    return out


def _series(run: Path, key: str) -> list[float]:
    return [m[key] for m in metrics(run) if m.get(key) is not None]


@pytest.mark.parametrize("layout", ["ddp-2", "fsdp-2", "zero3-2", "zero2-2", "fsdp-3"])
def test_layout_reproduces_the_single_process_run(runs, layout):
    for key in ("loss", "grad_norm", "eval_loss"):
        assert_close(_series(runs[layout], key), _series(runs["single"], key), REL, f"{layout} {key}")
    assert [m["step"] for m in metrics(runs[layout]) if "loss" in m] == [1, 2, 3, 4]
    assert [m["step"] for m in metrics(runs[layout]) if "eval_loss" in m] == [2, 3, 4]


def test_a_two_rank_checkpoint_resumes_on_one_process(runs):
    resumed = [m for m in metrics(runs["resumed-1"]) if m.get("loss") is not None]
    assert [m["step"] for m in resumed] == [3, 4]
    single = [m for m in metrics(runs["single"]) if m.get("loss") is not None][2:]
    for key in ("loss", "grad_norm", "lr"):
        assert_close([m[key] for m in resumed], [m[key] for m in single], RESUMED, f"resumed {key}")
    assert_close(
        _series(runs["resumed-1"], "eval_loss")[-1:], _series(runs["single"], "eval_loss")[-1:], RESUMED, "eval"
    )


def test_eval_of_the_run_masks_and_renders_as_training_did(runs):
    """`scaletune eval RUN --data` (the processor's rendering, the assistant's tokens scored) gives
    the run's own last eval loss on the same records."""
    data = runs["single"].parent / "digits" / "eval.jsonl"
    said = json.loads(_ok_out(run_cli(["eval", str(runs["single"]), "--data", str(data), "--json"])))
    assert said["examples"] == 16
    assert_close([said["loss"]], _series(runs["single"], "eval_loss")[-1:], 1e-6, "scaletune eval")


def _ok_out(out) -> str:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_final_holds_the_processor_and_reloads_in_transformers(runs):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    final = runs["ddp-2"] / "final"
    assert (final / "processor_config.json").is_file() and (final / "chat_template.jinja").is_file()
    record = json.loads((runs["single"].parent / "digits" / "eval.jsonl").read_text().splitlines()[0])
    image = Image.open(runs["single"].parent / "digits" / record["messages"][0]["content"][0]["path"]).convert("RGB")
    got = {}
    for name in ("ddp-2", "single"):
        processor = AutoProcessor.from_pretrained(runs[name] / "final")
        model = AutoModelForImageTextToText.from_pretrained(runs[name] / "final", dtype=torch.float32).eval()
        text = processor.apply_chat_template(record["messages"], tokenize=False)
        batch = processor(text=[text], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            got[name] = model(**batch).logits
    scale = got["single"].abs().max()
    assert (got["ddp-2"] - got["single"]).abs().max() <= REL * scale
    assert not torch.equal(got["single"], torch.zeros_like(got["single"]))


def _groups(tensors: dict) -> dict[str, dict]:
    """The tensors of a saved idefics3 model by group (`models.vision.parameter_groups`' modules)."""
    prefixes = {"vision": "model.vision_model.", "projector": "model.connector.", "language": "model.text_model."}
    out: dict[str, dict] = {g: {} for g in prefixes}
    for name, tensor in tensors.items():
        group = next((g for g, p in prefixes.items() if name.startswith(p)), "language")  # lm_head
        out[group][name] = tensor
    return out


def test_each_stage_leaves_what_it_freezes_bit_identical(runs, tiny_vlm_dir):
    import torch
    from safetensors.torch import load_file

    saved = {"initial": load_file(tiny_vlm_dir / "model.safetensors")}
    for step in (2, 3):
        out = runs["single"].parent / f"export-{step}"
        _ok(run_cli(["export", str(runs["single"] / "checkpoints" / f"step-{step}"), "-o", str(out)]))
        saved[f"step-{step}"] = load_file(out / "model.safetensors")
    saved["final"] = load_file(runs["single"] / "final" / "model.safetensors")
    assert (runs["single"].parent / "export-2" / "processor_config.json").is_file()
    before = {k: _groups(v) for k, v in saved.items()}
    for (a, b), trained in [
        (("initial", "step-2"), "projector"),
        (("step-2", "step-3"), "language"),
        (("step-3", "final"), "vision"),
    ]:
        for group, tensors in before[a].items():
            assert tensors.keys() == before[b][group].keys() and tensors, (a, b, group)
            same = all(torch.equal(t, before[b][group][name]) for name, t in tensors.items())
            if group == trained:
                assert not same, f"{group} did not train from {a} to {b}"
            elif b != "final":  # the last stage trains every group
                assert same, f"{group} changed from {a} to {b}, frozen in that stage"

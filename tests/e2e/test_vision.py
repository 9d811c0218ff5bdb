"""Vision-language models' data (issue 37): chat records with images, rendered by the model's own
processor, only the assistant's text trained; bad images refused in one message.

Model: the `idefics3-tiny` preset (tests/conftest.py `tiny_vlm_dir`). Data: scikit-learn's
handwritten digits as PNG files and chat records, as examples/vlm-digits/render_digits.py writes
them ("Which digit is this?" -> "7").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.helpers import assert_close, digit_chats, metrics, run_cli


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> dict[str, Path]:
    return digit_chats(tmp_path_factory.mktemp("digits"), 12, 4)


def _config(model: Path, train: Path, out: Path, **data) -> dict:
    return {
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "data": {"train": {"path": str(train), "format": "messages"}, "max_seq_length": 64, **data},
        "training": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 1},
        "output_dir": str(out),
    }


def test_only_the_assistants_text_is_trained(tiny_vlm_dir, digits):
    """Each row's trained tokens are exactly the tokenizer's own tokens of the assistant's turn as the
    chat template writes it (the rendered conversation after the rendered prompt), and no image
    token is ever a target; the image tensors are the processor's for the record's image."""
    from PIL import Image

    from scaletune.config import DataConfig, ModelConfig
    from scaletune.data.build import build_datasets
    from scaletune.models.vision import load_processor

    processor = load_processor(ModelConfig(name_or_path=str(tiny_vlm_dir)))
    tok = processor.tokenizer
    data = DataConfig(train={"path": str(digits["train"]), "format": "messages"}, max_seq_length=64)
    bundle = build_datasets(data, tok, seed=0, processor=processor)
    records = [json.loads(line) for line in digits["train"].read_text().splitlines()]
    assert len(bundle.train) == len(records) == 12
    image_ids = {tok.convert_tokens_to_ids(t) for t in ("<image>", "<fake_token_around_image>", "<global-img>")}
    for i, record in enumerate(records):
        row = bundle.train[i]
        trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert [label for label in row["labels"] if label != -100] == trained
        whole = processor.apply_chat_template(record["messages"], tokenize=False)
        prompt = processor.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
        assert whole.startswith(prompt)
        answer = whole[len(prompt) :]
        assert answer == f" {record['messages'][1]['content']}<end_of_utterance>\n"
        assert trained == tok(answer, add_special_tokens=False)["input_ids"]
        assert image_ids <= set(row["input_ids"]) and not image_ids & set(trained)
        # The image tensors: the processor's for this record's image file, as the model's forward takes them.
        image = Image.open(digits["train"].parent / record["messages"][0]["content"][0]["path"]).convert("RGB")
        want = processor.image_processor([[image]], return_tensors="pt")
        assert (row["images"]["pixel_values"] == want["pixel_values"]).all()
    batch = bundle.collator([bundle.train[i] for i in range(3)])
    assert batch["pixel_values"].shape == (3, 1, 3, 32, 32) and batch["pixel_attention_mask"].shape == (3, 1, 32, 32)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape


def test_bad_images_are_one_message_naming_each_and_nothing_is_written(tiny_vlm_dir, digits, tmp_path):
    """A missing image, a URL, a path out of the data's folder, a file that is not an image, one
    over `data.max_image_pixels` (refused from its header: a decompression bomb is never decoded) and
    an image in the assistant's turn: `scaletune train` exits 2 with one message naming each by
    file:line, before anything is written."""
    from PIL import Image

    folder = digits["train"].parent
    (tmp_path / "outside.png").write_bytes((folder / "images").iterdir().__next__().read_bytes())
    (folder / "images" / "not-an-image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    Image.new("L", (400, 400)).save(folder / "images" / "large.png")

    def user(path: str) -> dict:
        content = [{"type": "image", "path": path}, {"type": "text", "text": "Which digit is this?"}]
        return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "3"}]}

    good = digits["train"].read_text().splitlines()[:4]
    bad = [
        user("images/missing.png"),
        user("https://example.com/7.png"),
        user(f"../{tmp_path.name}/outside.png"),
        user("images/not-an-image.png"),
        user("images/large.png"),
        {
            "messages": [
                {"role": "user", "content": "Draw a three."},
                {"role": "assistant", "content": [{"type": "image", "path": "images/large.png"}]},
            ]
        },
    ]
    data = folder / "bad.jsonl"
    data.write_text("\n".join(good + [json.dumps(r) for r in bad]) + "\n")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(_config(tiny_vlm_dir, data, tmp_path / "run", max_image_pixels=100_000)))
    out = run_cli(["train", str(cfg)])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.strip().startswith("- ")]
    assert len(said) == 6, out.stderr
    for line, part, what in [
        (5, 0, "image 'images/missing.png' not found"),
        (6, 0, "image 'https://example.com/7.png' is a URL"),
        (7, 0, "is outside the data file's folder"),
        (8, 0, "image 'images/not-an-image.png': not a readable image"),
        (9, 0, "400x400 = 160,000 pixels, more than data.max_image_pixels 100,000"),
        (10, 1, "an image in an assistant turn"),
    ]:
        assert any(f"{data}:{line}: record {line}: messages[{part}].content[0]" in s and what in s for s in said), (
            line,
            out.stderr,
        )
    assert not (tmp_path / "run").exists()


def test_images_for_a_text_model_are_refused_naming_the_records(tiny_model_dir, digits, tmp_path):
    """Training data with images, and a prompt with one, for a text model: exit 2, by name."""
    cfg = tmp_path / "text.yaml"
    cfg.write_text(yaml.safe_dump(_config(tiny_model_dir, digits["train"], tmp_path / "run")))
    out = run_cli(["train", str(cfg)])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "12 records hold images, and the model is a text-only model" in out.stderr, out.stderr
    assert f"{digits['train']}:1: record 1" in out.stderr and "and 7 more" in out.stderr
    assert not (tmp_path / "run").exists()
    # A prompt with an image, for the same text model: refused, not rendered as text.
    prompts = digits["train"].parent / "one-prompt.jsonl"
    image = json.loads(digits["train"].read_text().splitlines()[0])["messages"][0]["content"][0]["path"]
    prompts.write_text(json.dumps({"prompt": "Which digit is this?", "image": image}))
    out = run_cli(["generate", str(tiny_model_dir), "--prompts", str(prompts), "--max-new-tokens", "2"])
    assert out.returncode == 2 and "prompts with image parts need a vision-language model" in out.stderr, out.stderr


def test_a_lora_run_exports_merged_with_the_logits_of_its_adapter(tiny_vlm_dir, digits, tmp_path):
    """LoRA on the language model only (its auto targets: the vision tower's attention shares the
    leaf names), two steps through `scaletune train` that train the projector beside the adapters
    (`trainable: [projector, language]`, the LLaVA recipe); `scaletune export --merge-lora` reloads in
    transformers with the logits of final/'s adapter on its base (peft), on an image and its question
    (1e-5 of the largest). final/ carries the trained projector as peft's `modules_to_save`: peft
    loads it over the base's, and its eval loss is the one the run logged at its end (the control:
    with the base's projector it is not); `scaletune export` of the run's checkpoint writes the same
    adapter file. The run answers questions about images: `scaletune generate`
    (prompts with an `image`) and `scaletune chat --image` give transformers' own greedy answers on
    the export."""
    import torch
    from peft import PeftModel
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cfg = _config(tiny_vlm_dir, digits["train"], tmp_path / "run")
    cfg["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    cfg["training"].update(max_steps=2, learning_rate=1e-2, save_every=2)
    cfg["data"]["eval"] = {"path": str(digits["eval"]), "format": "messages"}
    cfg["stages"] = [{"name": "all", "trainable": ["projector", "language"]}]
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli(["train", str(path)])
    assert out.returncode == 0, out.stderr[-3000:]
    final = tmp_path / "run" / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["target_modules"] and all("text_model" in t for t in adapter["target_modules"]), adapter
    assert adapter["modules_to_save"] == ["model.connector.modality_projection.proj"], adapter
    logged = [m["eval_loss"] for m in metrics(tmp_path / "run") if "eval_loss" in m]
    out = run_cli(["eval", str(final), "--data", str(digits["eval"]), "--format", "messages", "--json"])
    assert out.returncode == 0, out.stderr[-3000:]
    reloaded = json.loads(out.stdout)["loss"]
    assert reloaded == pytest.approx(logged[-1], rel=1e-5), (reloaded, logged)
    # The adapter `scaletune export` writes from the run's checkpoint, in another process, is final/'s.
    out = run_cli(["export", str(tmp_path / "run" / "checkpoints" / "step-2"), "-o", str(tmp_path / "adapter")])
    assert out.returncode == 0, out.stderr[-3000:]
    exported = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert exported["modules_to_save"] == adapter["modules_to_save"], exported
    held, wrote = (load_file(d / "adapter_model.safetensors") for d in (final, tmp_path / "adapter"))
    assert held.keys() == wrote.keys() and all(torch.equal(held[k], wrote[k]) for k in held)
    out = run_cli(["export", str(tmp_path / "run"), "-o", str(tmp_path / "merged"), "--merge-lora"])
    assert out.returncode == 0, out.stderr[-3000:]

    record = json.loads(digits["eval"].read_text().splitlines()[0])
    image = Image.open(digits["eval"].parent / record["messages"][0]["content"][0]["path"]).convert("RGB")
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    text = processor.apply_chat_template(record["messages"], tokenize=False)
    batch = processor(text=[text], images=[[image]], return_tensors="pt")
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32)
    projector = "model.connector.modality_projection.proj.weight"
    base_projector = base.state_dict()[projector].clone()  # peft wraps the module in place below
    with torch.no_grad():
        before = base(**batch).logits
        control = PeftModel.from_pretrained(base, final).eval()(**batch).logits
        merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32)(**batch).logits
    scale = control.abs().max()
    assert (merged - control).abs().max() <= 1e-5 * scale
    assert (control - before).abs().max() > 1e-3 * scale  # the adapter trained
    trained = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()[
        projector
    ]
    assert (trained - base_projector).abs().max() > 1e-4  # it trained, and the merge kept it

    # Answers about images: the command line against transformers' generate on the same folder.
    images = [r["messages"][0]["content"][0]["path"] for r in map(json.loads, digits["eval"].read_text().splitlines())]
    prompts = digits["eval"].parent / "prompts.jsonl"  # image paths are relative to the prompts file
    prompts.write_text("".join(json.dumps({"prompt": "Which digit is this?", "image": i}) + "\n" for i in images[:3]))
    out = run_cli(["generate", str(tmp_path / "merged"), "--prompts", str(prompts), "--max-new-tokens", "4"])
    assert out.returncode == 0, out.stderr[-3000:]
    said = [json.loads(line)["response"] for line in out.stdout.splitlines()]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    want = []
    for i in images[:3]:
        conversation = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which digit is this?"}]}
        ]
        text = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        image = Image.open(digits["eval"].parent / i).convert("RGB")
        batch = processor(text=[text], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            new = model.generate(**batch, max_new_tokens=4, do_sample=False)[0, batch["input_ids"].shape[1] :]
        want.append(processor.tokenizer.decode(new, skip_special_tokens=True).strip())
    assert said == want, (said, want)
    out = run_cli(
        [
            "chat",
            str(tmp_path / "merged"),
            "--image",
            str(digits["eval"].parent / images[0]),
            "--temperature",
            "0",
            "--max-new-tokens",
            "4",
        ],
        input="Which digit is this?\n",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("model>", 1)[1].strip() == want[0], out.stdout


def test_llava_trains_projector_and_adapters_and_reloads_as_transformers_measures_it(tiny_llava_dir, digits, tmp_path):
    """LLaVA (its CLIP vision tower, MLP projector and Llama language model; an image is 16 tokens)
    with LLaVA's recipe through `scaletune train`: the projector trained beside LoRA on the language
    model, an eval set. The rows train the assistant's text only (the tokenizer's tokens of the answer
    as the template writes it), each prompt holding its image's 16 tokens. The control: transformers'
    own loss (the model's forward with labels) of final/ reloaded by peft, on the eval rows as one
    batch, is the eval_loss the run logged at its end (1e-5); the base model's is not."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from scaletune.config import DataConfig, ModelConfig
    from scaletune.data.build import build_datasets
    from scaletune.models.vision import load_processor

    processor = load_processor(ModelConfig(name_or_path=str(tiny_llava_dir)))
    tok, image = processor.tokenizer, processor.tokenizer.convert_tokens_to_ids("<image>")
    data = DataConfig(train={"path": str(digits["eval"]), "format": "messages"}, max_seq_length=64)
    rows = build_datasets(data, tok, seed=0, processor=processor).train
    records = [json.loads(line) for line in digits["eval"].read_text().splitlines()]
    for i, record in enumerate(records):
        row = rows[i]
        trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert trained == tok(f" {record['messages'][1]['content']}</s>\n", add_special_tokens=False)["input_ids"]
        assert list(row["input_ids"]).count(image) == 16 and image not in trained

    cfg = _config(
        tiny_llava_dir, digits["train"], tmp_path / "run", eval={"path": str(digits["eval"]), "format": "messages"}
    )
    cfg["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    cfg["training"].update(max_steps=3, learning_rate=1e-2)
    cfg["stages"] = [{"name": "all", "trainable": ["projector", "language"]}]
    path = tmp_path / "llava.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli(["train", str(path)])
    assert out.returncode == 0, out.stderr[-3000:]
    final = tmp_path / "run" / "final"
    assert json.loads((final / "adapter_config.json").read_text())["modules_to_save"] == [
        "model.multi_modal_projector.linear_1",
        "model.multi_modal_projector.linear_2",
    ]
    logged = [m["eval_loss"] for m in metrics(tmp_path / "run") if "eval_loss" in m]
    batch = build_datasets(data, tok, seed=0, processor=processor).collator(list(rows))
    base = AutoModelForImageTextToText.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        untrained = float(base(**batch).loss)
        reloaded = float(PeftModel.from_pretrained(base, final).eval()(**batch).loss)
    assert reloaded == pytest.approx(logged[-1], rel=1e-5), (reloaded, logged)
    assert abs(untrained - logged[-1]) > 1e-3, (untrained, logged)


def test_gemma3_image_tokens_attend_both_ways_in_training_as_transformers_masks_them(tiny_gemma3_dir, digits, tmp_path):
    """Gemma 3 (SigLIP tower, pooled projector, a sliding-window and a global layer; an image is 4
    soft tokens between <start_of_image> and <end_of_image>), whose image tokens attend to each other
    both ways: the processor marks them in `token_type_ids`, which the rows keep (cut and padded with
    the tokens) and the loss passes to the model. Full fine-tuning of the projector and the language
    model through `scaletune train`, the vision tower frozen. The control: transformers' own loss
    (the model's forward with labels and `token_type_ids`) of final/ on the eval rows is the eval_loss
    the run logged at its end (1e-6); without `token_type_ids` (causal image tokens) it is not. The
    frozen vision tower's weights in final/ are the base's, bit for bit; the projector's are not. The
    same run at world size 2 (`distributed.num_processes=2`) reproduces its loss, grad norm and eval
    loss (1e-4)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from scaletune.config import DataConfig, ModelConfig
    from scaletune.data.build import build_datasets
    from scaletune.models.vision import load_processor

    processor = load_processor(ModelConfig(name_or_path=str(tiny_gemma3_dir)))
    tok = processor.tokenizer
    soft, frame = tok.image_token_id, {tok.boi_token_id, tok.eoi_token_id}
    data = DataConfig(train={"path": str(digits["eval"]), "format": "messages"}, max_seq_length=64)
    built = build_datasets(data, tok, seed=0, processor=processor)
    records = [json.loads(line) for line in digits["eval"].read_text().splitlines()]
    for i, record in enumerate(records):
        row = built.train[i]
        trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        answer = f"{record['messages'][1]['content']}<end_of_turn>\n"
        assert trained == tok(answer, add_special_tokens=False)["input_ids"], (trained, answer)
        assert (
            row["input_ids"].count(soft) == 4 and frame <= set(row["input_ids"]) and not ({soft} | frame) & set(trained)
        )
        assert row["token_type_ids"] == [int(t == soft) for t in row["input_ids"]]
    batch = built.collator([built.train[i] for i in range(len(built.train))])
    assert batch["token_type_ids"].shape == batch["input_ids"].shape
    assert (batch["token_type_ids"].bool() == (batch["input_ids"] == soft)).all()  # 0 on padding

    cfg = _config(
        tiny_gemma3_dir, digits["train"], tmp_path / "run", eval={"path": str(digits["eval"]), "format": "messages"}
    )
    cfg["training"].update(max_steps=6, learning_rate=5e-2)
    cfg["stages"] = [{"name": "all", "frozen": ["vision"]}]
    path = tmp_path / "gemma3.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli(["train", str(path)])
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [m["eval_loss"] for m in metrics(tmp_path / "run") if "eval_loss" in m]
    # World size 2, as users start it (re-executed under torchrun): the single process's steps.
    out = run_cli(["train", str(path), f"output_dir={tmp_path / 'ddp-2'}", "distributed.num_processes=2"])
    assert out.returncode == 0, out.stderr[-3000:]
    for key in ("loss", "grad_norm", "eval_loss"):
        single, ddp = ([m[key] for m in metrics(tmp_path / run) if key in m] for run in ("run", "ddp-2"))
        assert len(single) == (6 if key != "eval_loss" else 1)
        assert_close(ddp, single, 1e-4, f"gemma3 ddp-2 {key}")
    final = tmp_path / "run" / "final"
    base, trained = (load_file(d / "model.safetensors") for d in (tiny_gemma3_dir, final))
    tower = [k for k in base if k.startswith("vision_tower.")]
    assert tower and all(torch.equal(base[k], trained[k]) for k in tower)
    assert any(not torch.equal(base[k], trained[k]) for k in base if "multi_modal_projector" in k)
    model = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32).eval()
    with torch.no_grad():
        both_ways = float(model(**batch).loss)
        causal = float(model(**{k: v for k, v in batch.items() if k != "token_type_ids"}).loss)
    assert both_ways == pytest.approx(logged[-1], rel=1e-6), (both_ways, logged)
    # Four image tokens among ~30 move the loss little (2e-5 of it here), yet 20 times the tolerance above.
    assert abs(causal - logged[-1]) > 5e-6 * logged[-1], (causal, both_ways, logged)


def test_what_a_vision_language_run_cannot_do_yet_is_refused_by_name(tiny_vlm_dir, digits, tmp_path):
    """Packed rows and an objective other than sft: one exit-2 message naming each key, nothing written."""
    cfg = _config(tiny_vlm_dir, digits["train"], tmp_path / "run", packing=True)
    path = tmp_path / "packed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli(["train", str(path)])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "data.packing: a vision-language model's records are not packed" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()

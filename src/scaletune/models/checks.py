"""What the preflight asks of a model before anything loads it: its config readable, its weights
present and their safetensors headers inside their files, its attention implementation known; and
the position limit the data may not exceed."""

from __future__ import annotations

import json
import math
from pathlib import Path

from scaletune.config import ModelConfig
from scaletune.errors import Problem, UserError, texts
from scaletune.models.introspection import max_positions
from scaletune.models.loading import load_config
from scaletune.safe_load import scan_torch_file

#: Files that hold a Hugging Face model's weights.
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


#: Bytes per element of safetensors' dtype names (sub-byte and unknown dtypes: offsets checked only).
_ST_BYTES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}
_ST_BYTES |= {"U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
#: safetensors' own limit on the JSON header.
_ST_MAX_HEADER = 100_000_000


def _read_header(path: Path) -> tuple[dict, int] | Problem:
    """(the JSON header of a safetensors file, the bytes of tensor data after it), or the problem
    that stops reading it: the header's length, its JSON."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, _ST_MAX_HEADER):
                return _weights(
                    f"{path}: not a safetensors file: its header length {n} does not fit the file ({size} bytes)"
                )
            header = json.loads(f.read(n))
    except OSError as exc:
        return _weights(f"{path}: cannot be read: {exc.strerror or exc}")
    except ValueError as exc:
        return _weights(f"{path}: not a safetensors file: its header is not JSON ({exc})")
    if not isinstance(header, dict):
        return _weights(f"{path}: not a safetensors file: its header is not a JSON object")
    return header, size - 8 - n


def safetensors_problems(path: Path, limit: int = 3) -> list[Problem]:
    """What in a safetensors file's header does not fit the file, read without loading a tensor:
    the header's length, its JSON, and per tensor its dtype, shape and `data_offsets` (inside the
    data area, as long as the shape and dtype say). A header placing a tensor at offset 10^13
    passes a directory listing and fails much later, in the middle of loading.

    Returns:
        at most `limit` problems, each naming the file and the tensor; empty for a sound header.
    """
    read = _read_header(path)
    if isinstance(read, Problem):
        return [read]
    header, data = read
    problems: list[Problem] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        what = _tensor_problem(info, data)
        if what:
            problems.append(_weights(f"{path}: tensor {name!r}: {what}"))
            if len(problems) >= limit:
                break
    return problems


def stored_parameters(name_or_path: str) -> int | None:
    """The number of parameter elements a local model folder's safetensors files hold, read from
    their headers (no tensor, no model code): the model's parameter count, since transformers
    stores tied weights once. None for anything else (a hub id, pickled weights, a header that
    does not read: the preflight reports those)."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir() or (folder / "adapter_config.json").exists():
        return None  # an adapter folder's files hold the adapters, not the model they load onto
    files = sorted(folder.glob("*.safetensors"))
    total = 0
    for f in files:
        read = _read_header(f)
        if isinstance(read, Problem) or any(
            _tensor_problem(i, read[1]) for k, i in read[0].items() if k != "__metadata__"
        ):
            return None
        total += sum(math.prod(i["shape"]) for k, i in read[0].items() if k != "__metadata__")
    return total or None


def _weights(message: str) -> Problem:
    """A problem with a weights file (the message names it)."""
    return Problem("weights", None, message)


def _tensor_problem(info: object, data: int) -> str | None:
    if not isinstance(info, dict):
        return "its header entry is not an object"
    shape, offsets, dtype = info.get("shape"), info.get("data_offsets"), info.get("dtype")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return f"shape {shape!r} is not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return f"data_offsets {offsets!r} are not two integers"
    begin, end = offsets
    if not 0 <= begin <= end <= data:
        return f"data_offsets [{begin}, {end}] lie outside the file's {data} bytes of tensor data"
    width = _ST_BYTES.get(dtype) if isinstance(dtype, str) else None
    if width is not None and end - begin != math.prod(shape) * width:
        return f"{end - begin} bytes for a {dtype} tensor of shape {shape} ({math.prod(shape) * width} bytes)"
    return None


# The attention implementations transformers has registered since 4.48: a config naming one of
# them is answered without importing transformers.modeling_utils (about 2 s of CPU, a third of
# `train --check`). tests/unit/test_models.py holds this set inside transformers' own.
BUILTIN_ATTENTION = frozenset({"eager", "sdpa", "flash_attention_2", "flex_attention"})


def attention_problem(name: str | None) -> str | None:
    """`model.attn_implementation` must be one transformers knows (or a hub kernel `owner/name`)."""
    if name is None or "/" in name or name in BUILTIN_ATTENTION:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from scaletune.models.attention import CAUSAL_SDPA

    # CAUSAL_SDPA is scaletune's own, for one kind of forward; a model loaded with it would lose its masks.
    known = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()} - {CAUSAL_SDPA}
    known |= {part for key in list(known) for part in key.split("|")}
    if name in known:
        return None
    return f"model.attn_implementation {name!r} is not one transformers knows: {', '.join(sorted(known))} (or a hub kernel owner/name)"


def model_facts(cfg: ModelConfig) -> tuple[int | None, list[str]]:
    """(the model's position limit or None, the problems that would stop loading it), reading the
    config only: no weights, no model code unless `trust_remote_code`.
    """
    problems: list[str] = []
    bad_attention = attention_problem(cfg.attn_implementation)
    if bad_attention:
        problems.append(bad_attention)
    name = cfg.name_or_path
    folder = Path(name).expanduser()
    if folder.is_dir() and not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        problems.append(f"model.name_or_path {name!r}: the folder has no weights ({', '.join(WEIGHT_PATTERNS)})")
    if folder.is_dir():
        # Pickled weights from a stranger: their globals are scanned here, and loading them later runs
        # torch's restricted unpickler (safe_load.enforce); safetensors need neither.
        for f in sorted(p for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern)):
            try:
                scan_torch_file(f)
            except UserError as exc:
                problems += exc.problems
        for f in sorted(folder.glob("*.safetensors")):
            problems += texts(safetensors_problems(f))
    try:
        hf_config = load_config(cfg)
    except UserError as exc:
        return None, problems + exc.problems
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, [*problems, f"model.name_or_path {name!r}: its config cannot be read: {first}"]
    return max_positions(hf_config), problems

"""What the preflight asks of a model before anything loads it: its config readable, its weights
present, its attention implementation known; and the position limit the data may not exceed."""

from __future__ import annotations

from pathlib import Path

from scaletune.config import ModelConfig
from scaletune.errors import UserError
from scaletune.models.introspection import max_positions
from scaletune.models.loading import load_config
from scaletune.safe_load import scan_torch_file

#: Files that hold a Hugging Face model's weights.
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def attention_problem(name: str | None) -> str | None:
    """`model.attn_implementation` must be one transformers knows (or a hub kernel `owner/name`)."""
    if name is None or "/" in name:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
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
    try:
        hf_config = load_config(cfg)
    except UserError as exc:
        return None, problems + exc.problems
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, [*problems, f"model.name_or_path {name!r}: its config cannot be read: {first}"]
    return max_positions(hf_config), problems

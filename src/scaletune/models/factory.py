"""Your own model (`model.factory`): built, checked, given its initial weights, its blocks found
for FSDP2 / ZeRO-3 and for gradient checkpointing, exported and loaded back.

The contract is docs/custom-models.md. Python comes only from the reference in your config
(:mod:`scaletune.config.user_code`); weights only from safetensors files, which hold tensors and no code.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.config import ModelConfig
from scaletune.config.user_code import call_checked, import_callable
from scaletune.errors import UserError
from scaletune.models.introspection import decoder_layer_classes
from scaletune.models.loading import torch_dtype

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

#: What `final/` of a factory run holds besides the tokenizer / processor.
WEIGHTS_FILE = "model.safetensors"
FACTORY_FILE = "scaletune_factory.json"


def check_built(out: Any, ref: str) -> tuple[nn.Module, Any]:
    """(module, tokenizer or processor or None) from what a model factory returned.

    Raises:
        UserError: neither an `nn.Module` nor a pair `(nn.Module, tokenizer)`.
    """
    from torch import nn

    if isinstance(out, nn.Module):
        return out, None
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], nn.Module):
        return out[0], out[1]
    got = type(out).__name__
    if isinstance(out, tuple | list):
        got = f"a {got} of {', '.join(type(o).__name__ for o in out)}"
    raise UserError(
        f"model.factory {ref!r} returned {got}; it must return a torch.nn.Module or a pair "
        "(module, tokenizer or processor)",
        title="invalid factory",
    )


def build_model(cfg: ModelConfig, *, meta: bool = False, dtype: str | None = None, device: str = "cpu") -> tuple:
    """Call `model.factory` with `model.factory_kwargs` and prepare what it returns.

    Args:
        meta: build under `torch.device("meta")` (no storage; FSDP materialises the shards, the
            planner counts). A factory that cannot build there (it reads weights itself) is built
            normally, with a message. No initial weights are loaded on the meta device.
        dtype: storage dtype of the floating-point parameters and buffers (None: as built).
        device: where the module goes (not with `meta`).

    Returns:
        (module, tokenizer or processor or None).

    Raises:
        UserError: the reference does not import, the arguments do not fit, the result is not a
            module, `name_or_path` holds no usable safetensors.
    """
    import torch

    assert cfg.factory is not None
    fn = import_callable(cfg.factory, "model.factory")
    context = torch.device("meta") if meta else contextlib.nullcontext()
    try:
        with context:
            out = call_checked(fn, dict(cfg.factory_kwargs), "model.factory", cfg.factory)
    except UserError:
        raise
    except Exception as exc:
        if not meta:
            raise
        log.info(f"model.factory {cfg.factory}: cannot build on the meta device ({exc}); building it on the CPU")
        return build_model(cfg, dtype=dtype, device="cpu")
    module, processor = check_built(out, cfg.factory)
    if cfg.name_or_path is not None and not meta:
        load_initial_weights(module, cfg.name_or_path)
    if dtype is not None:
        module.to(torch_dtype(dtype))  # floating-point tensors only: integer buffers keep their dtype
    if not meta:
        module.to(device)
    return module, processor


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix == ".safetensors" else []
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    return []


def load_initial_weights(module: nn.Module, name_or_path: str) -> None:
    """Load `model.name_or_path` (a `.safetensors` file, or a folder with `model.safetensors` or a
    sharded index) into the factory's module, by parameter name. Tensors the file lacks keep the
    factory's values (logged); a tensor the module lacks, or of another shape, is an error.

    Raises:
        UserError: no safetensors there, a name the module does not have, a shape that differs.
    """
    from safetensors.torch import load_file

    path = Path(name_or_path).expanduser()
    files = _safetensors_files(path)
    if not files:
        raise UserError(
            f"model.name_or_path {name_or_path!r}: with model.factory it gives initial weights: a .safetensors "
            "file or a folder holding model.safetensors (or model.safetensors.index.json); found none",
            title="invalid model",
        )
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    own = module.state_dict()
    unknown = sorted(k for k in state if k not in own)
    if unknown:
        raise UserError(
            f"model.name_or_path {name_or_path!r}: {len(unknown)} tensor(s) are not in the factory's module, "
            f"e.g. {', '.join(unknown[:3])} (module tensors look like {', '.join(list(own)[:3])})",
            title="invalid model",
        )
    wrong = [f"{k} {list(v.shape)} vs {list(own[k].shape)}" for k, v in state.items() if v.shape != own[k].shape]
    if wrong:
        raise UserError(
            f"model.name_or_path {name_or_path!r}: shapes differ from the module's: {'; '.join(wrong[:3])}",
            title="invalid model",
        )
    module.load_state_dict(state, strict=False)
    kept = len(own) - len(state)
    log.info(
        f"model.name_or_path {name_or_path}: loaded {len(state)} tensors"
        + (f"; {kept} keep the factory's values" if kept else "")
    )


def shard_classes(module: nn.Module, names: list[str] | None = None) -> tuple[type, ...]:
    """The block classes of a factory's module: FSDP2 units, ZeRO-3 leaf modules, checkpointed.

    From `names` (`model.shard_modules`), else the module's `shard_modules` attribute, else its
    `_no_split_modules` (a Hugging Face model's blocks), else the elements of its largest ModuleList.

    Raises:
        UserError: a named class is not in the module.
    """
    wanted = names or getattr(module, "shard_modules", None) or getattr(module, "_no_split_modules", None)
    if not wanted:
        try:
            return tuple(sorted(decoder_layer_classes(module), key=lambda c: c.__name__))
        except ValueError:
            return ()
    wanted = [c if isinstance(c, str) else c.__name__ for c in wanted]
    found = {type(m) for m in module.modules() if type(m).__name__ in wanted}
    missing = sorted(set(wanted) - {c.__name__ for c in found})
    if missing:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise UserError(
            f"model.shard_modules: {', '.join(missing)} not in the factory's module (its classes: {', '.join(present)})",
            title="invalid model",
        )
    return tuple(sorted(found, key=lambda c: c.__name__))


def checkpoint_blocks(module: nn.Module, classes: tuple[type, ...]) -> int:
    """Gradient checkpointing of every block: each instance's forward runs under PyTorch's
    non-reentrant `torch.utils.checkpoint` (what DDP, FSDP2 and ZeRO-3 accept), its activations
    recomputed in backward. Parameter names do not change. Returns how many blocks."""
    from torch.utils.checkpoint import checkpoint

    blocks = [m for m in module.modules() if isinstance(m, classes)]
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)


def _dedup_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (tied weights): give each name its own copy."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in state.items():
        v = v.detach().to("cpu").contiguous()
        ident = (v.untyped_storage().data_ptr(), v.storage_offset())
        out[k] = v.clone() if ident in seen else v
        seen.add(ident)
    return out


def write_export(out_dir: Path, state: dict[str, torch.Tensor], cfg: ModelConfig, processor: Any = None) -> Path:
    """`final/` of a factory run: `model.safetensors` (the module's state dict), `scaletune_factory.json`
    (the factory reference, its kwargs and `shard_modules`) and the tokenizer / processor where it has
    `save_pretrained`. Load it back with :func:`load_custom_model`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(_dedup_shared(state), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {
        "factory": cfg.factory,
        "factory_kwargs": cfg.factory_kwargs,
        "shard_modules": cfg.shard_modules,
        "weights": WEIGHTS_FILE,
    }
    (out_dir / FACTORY_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if processor is not None and hasattr(processor, "save_pretrained"):
        processor.save_pretrained(str(out_dir))
    return out_dir


def load_custom_model(folder: str | Path, factory: str) -> tuple[nn.Module, Any]:
    """A factory run's export (`final/`, or `scaletune export`'s folder) as (module, processor).

    `factory` is yours to give (the folder's recorded reference is never imported: importing and
    calling a name read from a folder would run whatever it names); it must equal the recorded one,
    whose keyword arguments are then used.

    Raises:
        UserError: not an export folder; another factory than the one that wrote it.
    """
    folder = Path(folder)
    meta_file = folder / FACTORY_FILE
    if not meta_file.is_file():
        raise UserError(f"{folder} has no {FACTORY_FILE}: not the export of a model.factory run", title="invalid model")
    meta = json.loads(meta_file.read_text())
    if meta.get("factory") != factory:
        raise UserError(
            f"{folder} was written by factory {meta.get('factory')!r}, not {factory!r}", title="invalid model"
        )
    cfg = ModelConfig(
        factory=factory, factory_kwargs=meta.get("factory_kwargs") or {}, name_or_path=str(folder / WEIGHTS_FILE)
    )
    module, processor = build_model(cfg, dtype="float32")
    return module.eval(), processor

"""`reference: precomputed`: one pass at the start of a preference stage computes the reference
log-probs of every pair (both sides; KTO: the completion and its KL row) with the model as it is
then, and the stage's data carry them as columns, so no reference model stays resident.

Every rank scores rows r, r+W, ... of each split (the eval loader's deal, fillers included so every
rank runs the same forwards), and one all-reduce assembles the whole table on every rank. The table
is cached as safetensors (never a pickle) beside the tokenised data, keyed by the tokenised data
(records, format, tokenizer, template, max_seq_length: the data set's fingerprint), the model
(`model.name_or_path`, dtype, and for a local folder its weight files' sizes and times), how the
log-probs are computed (compute dtype, autocast or bf16 copies, quantization, the engine and its
world size, micro-batch size, attention kernel and packing, Liger, the device type: each changes
the numbers, and a table computed one way gives another run a non-zero margin at step 0) and where
the stage starts: only a first stage, which starts from the model itself, shares its table with
other runs of that data and model; a later stage starts from what the run trained before it. Each
run also keeps its stage's table in its run directory (`reference/stage-N.safetensors`), which a run
resuming inside the stage reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scaletune.env import print0

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec

__all__ = ["attach_reference", "cache_path", "precompute", "reference_tables"]


def _model_identity(spec: RunSpec) -> dict:
    m = spec.config.model
    ident: dict[str, Any] = {
        "name_or_path": m.name_or_path,
        "revision": getattr(m, "revision", None),
        "dtype": str(spec.precision.storage),
    }
    folder = Path(str(m.name_or_path)).expanduser()
    if folder.is_dir():
        ident["weights"] = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.iterdir()
            if p.suffix in (".safetensors", ".bin", ".pt")
        )
    return ident


def _computation(spec: RunSpec) -> dict:
    """Everything besides the weights and the data that changes a reference log-prob's value."""
    m, p = spec.config.model, spec.precision
    return {
        "compute": str(p.compute),
        "autocast": p.autocast,
        "cast_params": p.cast_params,
        "quantization": m.quantization.model_dump() if m.quantization is not None else None,
        "engine": spec.strategy_label,
        "world_size": spec.world_size,
        "mesh": str(spec.mesh),
        "micro_batch_size": spec.batch.micro_batch_size,
        "attention": m.attn_implementation,
        "packing": spec.packs,
        "liger": m.liger,
        "device": "cuda" if spec.env.cuda_available else "cpu",
    }


def cache_path(spec: RunSpec, stage_index: int, fingerprints: list[str]) -> Path:
    """The shared cache entry of a first stage's reference table (see the module docstring)."""
    from scaletune.data import cache_root

    key = json.dumps(
        {"data": fingerprints, "model": _model_identity(spec), "computed": _computation(spec), "stage": stage_index},
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_root(None).parent / "reference" / f"{digest}.safetensors"


@torch.no_grad()
def precompute(strategy: Any, dataset: Any, collator: Any, micro_batch_size: int) -> torch.Tensor:
    """[N, 2] float32 reference log-probs of `dataset`'s rows by their ``index`` (N = largest index + 1;
    a dropped pair's row stays 0): column 0 chosen (kto: the completion), 1 rejected (kto: its KL
    row). Runs the wrapped model on every rank (all ranks must call it).
    """
    from scaletune.data.batching import EvalBatches
    from scaletune.objectives.module import kl_inputs, preference_inputs

    env = strategy.env
    n = max(dataset["index"]) + 1
    table = torch.zeros(n, 2, dtype=torch.float64, device=strategy.device)
    strategy.train_mode(False)
    try:
        for mb, counted in EvalBatches(dataset, collator, micro_batch_size, env.rank, env.world_size):
            with strategy.forward_context():
                logp = strategy.model(**strategy.move_batch(preference_inputs(mb)), output="logps")
                if "kl_input_ids" in mb:  # kto: the completion rows, then the KL rows
                    kl_rows = strategy.model(**strategy.move_batch(kl_inputs(mb)), output="logps")
                    logp = torch.cat([logp, kl_rows])
            if counted:
                m = mb["index"].numel()
                index = mb["index"].to(table.device)
                pair = logp.detach().to(table.device, torch.float64).reshape(2, m).t()
                table.index_copy_(0, index, pair)
    finally:
        strategy.train_mode(True)
    return strategy.all_reduce_sum(table).float().cpu()


def attach_reference(dataset: Any, table: torch.Tensor, fmt: str) -> Any:
    """`dataset` with the columns the collator turns into ``ref_logps``."""
    names = ("ref_chosen", "ref_rejected") if fmt == "preference" else ("ref", "ref_kl")
    rows = table[torch.tensor(dataset["index"], dtype=torch.long)]
    for j, name in enumerate(names):
        if name in dataset.column_names:
            dataset = dataset.remove_columns(name)
        dataset = dataset.add_column(name, rows[:, j].tolist())
    return dataset


def reference_tables(strategy: Any, spec: RunSpec, plan: Any, collator: Any, *, resumed: bool) -> None:
    """Attach the stage's reference columns to its train and eval sets (`plan.bundle`).

    A run resuming inside the stage reads the table written when the stage began
    (``reference/stage-N.safetensors`` in the checkpoint's run directory, else its own: the model has
    trained since, so it cannot be recomputed); a first stage reads the shared cache when it has the entry; otherwise
    :func:`precompute`, then rank 0 writes both.

    Raises:
        UserError: resuming inside the stage, and its table is gone from the run directory.
    """
    from safetensors.torch import load_file, save_file

    from scaletune.errors import UserError

    bundle, stage = plan.bundle, plan.stage
    fmt = stage.data.train.format
    splits = {"train": bundle.train} | ({"eval": bundle.eval} if bundle.eval is not None else {})
    own = spec.run_dir / "reference" / f"stage-{stage.index}.safetensors"
    shared = cache_path(spec, stage.index, [ds._fingerprint for ds in splits.values()]) if stage.index == 0 else None
    if resumed:
        # The checkpoint's own run directory first (a run may resume from another run's checkpoint).
        assert spec.resume_from is not None
        found = [p for p in (spec.resume_from.parent.parent / own.parent.name / own.name, own) if p.is_file()]
        if not found:
            raise UserError(
                f"{own.name} is missing from {spec.resume_from.parent.parent / own.parent.name}: the reference "
                f"log-probs of stage {stage.name} were computed when the stage began and cannot be recomputed from "
                "the model trained since. Restore the file, or restart the stage",
                title="cannot resume",
            )
        tables, source = load_file(str(found[0])), str(found[0])
    elif shared is not None and shared.is_file():
        tables, source = load_file(str(shared)), f"the cache, {shared}"
    else:
        tables = {name: precompute(strategy, ds, collator, plan.batch.micro_batch_size) for name, ds in splits.items()}
        source = f"{sum(len(ds) for ds in splits.values()):,} pairs scored once"
    if strategy.env.is_main:
        targets = [] if own.is_file() and resumed else [own]  # a resumed run keeps a copy for its own resumes
        for path in targets + ([shared] if shared is not None and not shared.is_file() and not resumed else []):
            path.parent.mkdir(parents=True, exist_ok=True)
            # Unique per writer: two runs of the same data and model may fill the shared entry at once.
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            save_file({k: v.contiguous() for k, v in tables.items()}, str(tmp))
            tmp.replace(path)
    strategy.barrier()
    print0(f"[scaletune] stage {stage.name}: reference log-probs (reference: precomputed) from {source}")
    bundle.train = attach_reference(bundle.train, tables["train"], fmt)
    if bundle.eval is not None:
        bundle.eval = attach_reference(bundle.eval, tables["eval"], fmt)

"""Presenting a plan: the rich tables (strategies; device meshes), the recommended mesh's
arithmetic, the model's shape in one line, and the target machine that `scaletune plan` plans for
(options, or this machine)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from scaletune.env import DistributedEnv
from scaletune.plan.activations import IMAGES_PER_ROW, LOSS_CHUNK
from scaletune.plan.estimates import GiB, Plan
from scaletune.plan.mesh import MeshChoice, mesh_name, mesh_shard_elements, run_layout
from scaletune.plan.shapes import ModelShape
from scaletune.resolve import FLOAT_DTYPES

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def render_table(p: Plan, marked: str | None = None) -> Any:
    """A rich Table of the plan (GiB per rank), the row `marked` (default: the planner's choice)
    starred; its caption says what the preference reference costs."""
    marked = p.chosen if marked is None else marked
    from rich.table import Table

    mem = f"{p.gpu_memory_bytes / GiB:.0f} GiB" if p.gpu_memory_bytes else "unknown memory"
    caption = p.reference.note if p.reference is not None and p.reference.mode != "none" else None
    t = Table(
        title=f"memory per rank, world size {p.world_size} ({p.nodes} node(s)), {mem} per device; GiB",
        caption=caption,
    )
    for col in (
        "strategy",
        "params",
        "grads",
        "optimizer",
        "activations",
        "reference",
        *(("kv cache",) if p.rollout is not None else ()),
        "act. no ckpt",
        "act. ckpt",
        "margin",
        "total",
        "host",
        "fits",
    ):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for s in p.strategies:
        fits = "-" if s.fits is None else ("yes" if s.fits else "no")
        mark = " *" if s.name == marked else ""
        t.add_row(
            s.name + mark,
            _gib(s.params),
            _gib(s.grads),
            _gib(s.optimizer),
            _gib(s.activations),
            _gib(s.reference),
            *((_gib(s.kv_cache),) if p.rollout is not None else ()),
            _gib(s.activations_no_ckpt),
            _gib(s.activations_ckpt),
            _gib(s.margin),
            _gib(s.total),
            _gib(s.host_bytes),
            fits,
        )
    return t


def describe_shape(shape: ModelShape) -> str:
    stage = f" in stage {shape.stage} (the stage that trains the most)" if shape.stage else ""
    head = f"{shape.model_type or 'model'}: {shape.total:,} parameters ({shape.trainable:,} trainable{stage}), "
    if shape.activations is not None:  # a factory's module: no transformer dimensions to show
        return (
            head
            + f"{shape.layers} blocks; activations measured on the meta device: {shape.activations:,} bytes per micro-batch"
        )
    text = (
        f"{shape.layers} layers x {shape.hidden} hidden, {shape.heads} heads ({shape.kv_heads} kv), "
        f"MLP {shape.intermediate}, vocab {shape.vocab}"
    )
    v = shape.vision
    if v is None:
        return head + text
    return head + (
        f"language model {text}; vision tower {v.layers} layers x {v.hidden} hidden, {v.positions} positions an "
        f"image ({IMAGES_PER_ROW} image a row planned), {'trained' if v.trains else 'frozen: no activations'}"
    )


def target_env(gpus: int | None, gpu_memory_gib: float | None, nodes: int = 1) -> tuple[DistributedEnv, int, str]:
    """The machine `scaletune plan` plans for: `--gpus` per node (world size = gpus x nodes), or
    the GPUs torch sees; without GPUs one CPU process with the machine's RAM as its "device" memory,
    unless `--gpu-memory` is given (planning for GPUs from a CPU machine: bf16 assumed supported).

    Returns:
        (environment with `device_memory_bytes` set where known, world size, a note saying where
        the numbers came from).
    """
    import torch

    cuda = torch.cuda.is_available()
    notes = []
    if gpus is None:
        if cuda:
            gpus = torch.cuda.device_count()
            notes.append(f"{gpus} visible GPU(s) per node")
        else:
            gpus = 1
            notes.append("no GPU visible: planning one CPU process (pass --gpus N --gpu-memory GIB to plan for GPUs)")
    else:
        cuda = gpus > 0 or cuda
        gpus = max(gpus, 1)
    if gpu_memory_gib is not None:
        mem: int | None = int(gpu_memory_gib * GiB)
    elif torch.cuda.is_available():
        mem = int(torch.cuda.get_device_properties(0).total_memory)
        notes.append(f"{mem / GiB:.0f} GiB per GPU ({torch.cuda.get_device_name(0)})")
    elif not cuda:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        notes.append(f"{mem / GiB:.0f} GiB of RAM")
    else:
        mem = None
        notes.append("device memory unknown: pass --gpu-memory GIB to know what fits")
    bf16 = bool(torch.cuda.is_bf16_supported()) if torch.cuda.is_available() else cuda
    world = gpus * nodes
    env = DistributedEnv(
        "none" if world == 1 else "env",
        world_size=world,
        local_world_size=gpus,
        cuda_available=cuda,
        cuda_device_count=gpus if cuda else 0,
        device_memory_bytes=mem,
        bf16_supported=bf16,
    )
    return env, world, "; ".join(notes)


def render_mesh(choice: MeshChoice) -> Any:
    """A rich Table of the meshes the recommendation looked at (GiB per rank), the chosen one marked."""
    from rich.table import Table

    mem = f"{choice.gpu_memory_bytes / GiB:.1f} GiB" if choice.gpu_memory_bytes else "unknown memory"
    t = Table(title=f"device mesh per rank, {choice.seq_len:,} tokens a sequence, {mem} per device; GiB")
    for col in ("mesh", "params", "grads", "optimizer", "activations", "margin", "total", "fits"):
        t.add_column(col, justify="left" if col in ("mesh", "fits") else "right")
    for c in choice.candidates:
        mark = " *" if c is choice.chosen else ""
        if c.entry is None:
            t.add_row(mesh_name(c.mesh) + mark, *["-"] * 6, f"ruled out: {c.ruled_out}")
            continue
        e = c.entry
        fits = "-" if e.fits is None else ("yes" if e.fits else "no")
        row = (e.params, e.grads, e.optimizer, e.activations, e.margin, e.total)
        t.add_row(e.name + mark, *(_gib(n) for n in row), fits)
    return t


def mesh_arithmetic(spec: RunSpec, shape: ModelShape, choice: MeshChoice) -> list[str]:
    """The chosen mesh's bytes per rank term by term (`plan/mesh.py`, `plan/activations.py`), and
    what each smaller mesh needs."""
    if choice.chosen is None or choice.chosen.entry is None:
        return [f"no mesh recommended: {choice.reason}"]
    m, e = choice.chosen.mesh, choice.chosen.entry
    b_c = FLOAT_DTYPES[spec.precision.compute][0]
    trainable = [p for p in shape.params if p.trainable]
    layout = run_layout(spec)
    n_t = sum(mesh_shard_elements(p, m, layout) for p in trainable)
    n_f = sum(mesh_shard_elements(p, m, layout) for p in shape.params if not p.trainable)
    s, b = choice.seq_len, spec.batch.micro_batch_size
    tokens = -(-s // m.context) * b
    layer_inputs = shape.layers * tokens * shape.hidden * b_c
    loss = min(LOSS_CHUNK, tokens) * (-(-shape.vocab // m.tensor)) * (b_c + 12)
    edges = 2 * tokens * shape.hidden * b_c
    if spec.config.model.gradient_checkpointing:
        act = (
            f"{shape.layers} checkpointed layer inputs x {tokens:,} tokens ({s:,} / context {m.context} x micro_batch "
            f"{b}) x {shape.hidden} x {b_c} B = {_gib(layer_inputs)} + one recomputed layer "
            f"{_gib(e.activations - layer_inputs - loss - edges)} + loss chunk {_gib(loss)} + edges {_gib(edges)}"
        )
    else:
        act = f"{shape.layers} layers x {tokens:,} tokens ({s:,} / context {m.context} x micro_batch {b}), no checkpointing"
    dc = m.data_shard * m.context
    gpu = choice.gpu_memory_bytes or 0
    lines = [
        f"recommended mesh: {e.name} = strategy fsdp, context_parallel {m.context}, tensor_parallel {m.tensor} "
        f"({m.describe()}) - {choice.reason}",
        f"  per rank: FSDP2 shards over data_shard x context = {dc} ranks, projections split over tensor {m.tensor}",
        f"  params      {_gib(e.params):>8} GiB = 4 B x {n_t:,} trainable elements (fp32) + {b_c} B x {n_f:,} frozen",
        f"  grads       {_gib(e.grads):>8} GiB = 4 B x {n_t:,}",
        f"  optimizer   {_gib(e.optimizer):>8} GiB = 8 B x {n_t:,} (AdamW exp_avg, exp_avg_sq) + 4 B x {len(trainable)} steps",
        f"  activations {_gib(e.activations):>8} GiB = {act}",
        f"  margin      {_gib(e.margin):>8} GiB = one unsharded layer and its neighbour and gradient + 10% of the rest",
        f"  total       {_gib(e.total):>8} GiB <= {gpu / GiB:.2f} GiB",
    ]
    for c in choice.candidates:
        if c is choice.chosen:
            break
        if c.entry is None:
            lines.append(f"  {mesh_name(c.mesh)}: ruled out: {c.ruled_out}")
        else:
            lines.append(
                f"  {c.entry.name}: needs {_gib(c.entry.total)} GiB (activations {_gib(c.entry.activations)}) "
                f"> {gpu / GiB:.2f} GiB"
            )
    return lines


def mesh_notes(spec: RunSpec, p: Plan) -> list[str]:
    """Lines on online RL's generation memory (its KV-cache arithmetic), the configured mesh (its
    entry, the model's rules on it) and a sequence longer than the model's positions."""
    out: list[str] = [p.rollout.arithmetic()] if p.rollout is not None else []
    hf_config = None
    if not spec.custom_model:
        from scaletune.models import load_config

        hf_config = load_config(spec.config.model)
    if p.mesh is not None:
        e = p.mesh
        out.append(
            f"configured mesh {e.name} ({spec.mesh.describe()}): {_gib(e.total)} GiB per rank (params {_gib(e.params)}, "
            f"grads {_gib(e.grads)}, optimizer {_gib(e.optimizer)}, activations {_gib(e.activations)}, margin {_gib(e.margin)})"
        )
        if hf_config is not None:
            from scaletune.resolve.mesh import model_mesh_problems

            for problem in model_mesh_problems(spec.mesh, hf_config):
                out.append(f"warning: {problem.message} ({problem.fix})")
    if spec.mesh.pipeline > 1:
        out.append(
            "note: with pipeline stages the parameters, gradients and optimizer state are rank 0's (the first "
            "stage's layers and the embeddings); its activations are planned as one micro-batch through every layer "
            "(1F1B keeps up to pipeline_parallel micro-batches in flight on the first stage, each through its layers)"
        )
    s, limit = spec.batch.max_seq_length, spec.max_positions
    if limit is None and hf_config is not None:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and s > limit:
        out.append(
            f"note: {s:,} tokens is more than the model's max_position_embeddings ({limit:,}); the memory is planned "
            "all the same, but training needs a model built for that length"
        )
    return out

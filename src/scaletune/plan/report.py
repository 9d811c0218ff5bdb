"""Presenting a plan: the rich table, the model's shape in one line, and the target machine that
`scaletune plan` plans for (options, or this machine)."""

from __future__ import annotations

import os
from typing import Any

from scaletune.env import DistributedEnv
from scaletune.plan.estimates import GiB, Plan
from scaletune.plan.shapes import ModelShape


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def render_table(p: Plan) -> Any:
    """A rich Table of the plan (GiB per rank); its caption says what the preference reference costs."""
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
        mark = " *" if s.name == p.chosen else ""
        t.add_row(
            s.name + mark,
            _gib(s.params),
            _gib(s.grads),
            _gib(s.optimizer),
            _gib(s.activations),
            _gib(s.reference),
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
    return head + (
        f"{shape.layers} layers x {shape.hidden} hidden, {shape.heads} heads ({shape.kv_heads} kv), "
        f"MLP {shape.intermediate}, vocab {shape.vocab}"
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

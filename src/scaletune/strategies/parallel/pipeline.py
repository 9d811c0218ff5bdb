"""Pipeline parallelism: a Hugging Face decoder split into contiguous stages, one per pipeline rank,
run by `torch.distributed.pipelining` (`PipelineStage` and the 1F1B schedule).

The split is torchtitan's (`torchtitan/distributed/pipeline_parallel.py`, `pipeline_module_split`):
each stage keeps the whole model object but only its own decoder layers (in an `nn.ModuleDict`
keyed by the original layer index, so ``model.layers.5.mlp.up_proj.weight`` keeps its name), and
the embeddings, final norm and head are set to None on the stages that do not run them. Every kept
parameter has its original fully qualified name, so a DCP checkpoint reshards across pipeline
degrees. The stage module wraps the model under ``causal_lm`` as `models.loss.CausalLMLoss` does,
so its names are the loss module's.

The last stage runs the head and the loss inside its forward (scaletune's chunked head
cross-entropy at target positions), so an FSDP2 root around the stage gathers the head's weight and
reduces its gradient with its own hooks, as for `CausalLMLoss`. Each micro-batch's loss is its
summed token loss divided by the step's global target count; the schedule's own gradient scaling is
off (`scale_grads=False`), so the gradients are those of one process on the whole batch.

The pipelining API used here (`PipelineStage(module, stage_index, num_stages, device, group=)` with
shape inference at the schedule's first step, `Schedule1F1B(stage, n, loss_fn=, scale_grads=)`,
`step(*args, target=, losses=, return_outputs=, **kwargs)`, `eval(...)`) is the same in torch 2.11
and 2.13; older torch is refused (:func:`require_pipelining_torch`). A schedule infers its stage's
shapes once and keeps fixed-shape receive buffers, so `PipelineRunner` pads every step to one
shape (grown only when a step does not fit) and keeps separate training and evaluation schedules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletune.models.attention import full_causal_only, packed_mask
from scaletune.models.introspection import unwrap
from scaletune.models.loss import IGNORE_INDEX, chunked_head_cross_entropy

__all__ = [
    "MIN_TORCH",
    "PipelineRunner",
    "PipelineStageModule",
    "padded_length",
    "pipeline_clip_grad_norm_",
    "pipeline_grad_norm",
    "require_pipelining_torch",
    "split_stage",
    "stage_layers",
]


#: The oldest torch whose `torch.distributed.pipelining` this module is written and checked against
#: (2.11, the GPU machines' torch, and 2.13): the API it uses is the same in both.
MIN_TORCH = (2, 11)


def require_pipelining_torch(version: str | None = None) -> None:
    """Refuse a torch older than :data:`MIN_TORCH` for pipeline parallelism (called at strategy
    setup, by :func:`split_stage`, before any step).

    Args:
        version: a torch version string (``"2.11.0+cu130"``); default the installed ``torch.__version__``.

    Raises:
        RuntimeError: the version is older than 2.11 (or unreadable).
    """
    found = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or (int(match[1]), int(match[2])) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise RuntimeError(
            f"pipeline parallelism (distributed.pipeline_parallel > 1) needs torch >= {need}, found torch {found}: "
            f"its torch.distributed.pipelining API (PipelineStage shape inference, Schedule1F1B with scale_grads "
            f"and step(return_outputs=)) is checked against torch {need} and later; install torch>={need} or use "
            "pipeline_parallel: 1"
        )


def head_name(base: nn.Module) -> str:
    head = base.get_output_embeddings()
    for name, child in base.named_children():
        if child is head:
            return name
    raise ValueError(f"{type(base).__name__}: its output embeddings are not a direct child module")


def stage_layers(num_layers: int, stage_index: int, num_stages: int) -> range:
    """The decoder layers of `stage_index`: contiguous, even, the first `num_layers % num_stages`
    stages one layer more.

    Raises:
        ValueError: `stage_index` outside ``[0, num_stages)`` or fewer layers than stages.
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"pipeline stage {stage_index} outside 0..{num_stages - 1}")
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} decoder layers cannot fill {num_stages} pipeline stages")
    per, extra = divmod(num_layers, num_stages)
    start = stage_index * per + min(stage_index, extra)
    return range(start, start + per + (stage_index < extra))


class PipelineStageModule(nn.Module):
    """One pipeline stage of a Hugging Face decoder-only LM (built by :func:`split_stage`).

    forward(x, position_ids=None, labels=None):

    * x: stage 0: ``input_ids`` [B, T] int64; later stages: hidden states [B, T, hidden] from the
      previous stage.
    * position_ids: [B, T] int64, restarting at 0 at each packed example (packed rows); None for
      unpadded or right-padded rows (positions 0..T-1, plain causal attention: a right-padded row's
      padding keys come after every real query, so causal masking alone excludes them).
    * labels: [B, T] unshifted, -100 where not trained; used by the last stage only.

    Returns the hidden states [B, T, hidden] on every stage but the last, which returns the 0-dim
    float32 sum of the next-token cross-entropy over all target positions.
    """

    def __init__(self, causal_lm: nn.Module, stage_index: int, num_stages: int, chunk: int | None = None) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.stage_index, self.num_stages, self.chunk = stage_index, num_stages, chunk
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        #: The unsplit model's layers, embeddings, norm and head (a plain dict: not this stage's
        #: submodules), set by `stages.split_into_stage` for the export's `stages.whole`.
        self.unsplit: dict[str, Any] = {}

    def _mask(self, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> Any:
        from transformers.masking_utils import create_causal_mask

        config = unwrap(self.causal_lm).config
        if position_ids is not None:
            mask = packed_mask(config, position_ids)  # sdpa / flex_attention: built here, no host sync
            if mask is not None:
                return mask
        # Other implementations (eager) or models: transformers' own mask (None for sdpa = is_causal).
        # The cache goes by position: transformers 5.17 names it `past_key_values`, 5.24 `cache`.
        return create_causal_mask(config, hidden, None, None, position_ids=position_ids)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        base = unwrap(self.causal_lm)
        decoder = base.get_decoder()
        hidden = decoder.embed_tokens(x) if self.is_first else x
        positions = position_ids
        if positions is None:
            positions = torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)
        mask = self._mask(hidden, position_ids)
        position_embeddings = decoder.rotary_emb(hidden, position_ids=positions)
        for layer in decoder.layers.values():
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=positions,
                use_cache=False,
            )
        if not self.is_last:
            return hidden
        if labels is None:
            raise ValueError("the last pipeline stage needs the labels")
        hidden = decoder.norm(hidden)[:, :-1, :].reshape(-1, hidden.size(-1))
        shifted = labels[:, 1:].reshape(-1).to(hidden.device)
        # A device-side index (one host sync per micro-batch on a GPU, in nonzero): the schedule
        # splits only batch-shaped tensors, so the host-computed target_index cannot come along.
        index = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
        head = base.get_output_embeddings()
        return chunked_head_cross_entropy(
            hidden.index_select(0, index), head, shifted.index_select(0, index), self.chunk
        )


def split_stage(
    causal_lm: nn.Module, stage_index: int, num_stages: int, chunk: int | None = None
) -> PipelineStageModule:
    """This rank's pipeline stage of `causal_lm`, which is modified in place (layers dropped).

    Stage `stage_index` keeps the decoder layers :func:`stage_layers` gives it (in an
    `nn.ModuleDict` keyed by their original index), stage 0 the token embeddings, the last stage
    the final norm and the head; every stage keeps the rotary embedding (no parameters). The other
    modules become None (torchtitan's split). Parameter names are the model's own under the
    ``causal_lm.`` prefix of `models.loss.CausalLMLoss`.

    Args:
        causal_lm: a Hugging Face decoder-only LM (Llama / OLMo-2 family: ``model.embed_tokens``,
            ``model.layers`` (ModuleList), ``model.norm``, ``model.rotary_emb``, ``lm_head``), or a
            peft model around one; on any device, the meta device included.
        stage_index: this rank's stage, 0 .. num_stages - 1.
        num_stages: the pipeline degree.
        chunk: target rows per head+loss chunk (`models.loss.chunked_head_cross_entropy`).

    Raises:
        ValueError: a bad stage index, fewer layers than stages, a model without that layout or
            with other than plain causal attention layers (sliding window, chunked), or a head tied to the input embeddings with more than one stage (they would sit on two
            ranks; torchtitan does not split tied models either).
        RuntimeError: more than one stage on a torch older than 2.11 (:func:`require_pipelining_torch`).
    """
    if num_stages > 1:
        require_pipelining_torch()
    base = unwrap(causal_lm)
    decoder = base.get_decoder()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            raise ValueError(f"{type(base).__name__}: pipeline stages need a decoder with `{name}`")
    if not full_causal_only(base.config):
        # The stages build one mask for all their layers; sliding-window or chunked layers need their own.
        raise ValueError(f"{type(base).__name__}: pipeline stages support plain causal attention in every layer only")
    head = base.get_output_embeddings()
    if num_stages > 1 and head is not None and head.weight is decoder.embed_tokens.weight:
        raise ValueError(
            f"{type(base).__name__} ties its head to the input embeddings: pipeline parallelism needs an untied head"
        )
    layers = decoder.layers
    if isinstance(layers, nn.ModuleDict):
        raise ValueError("the model is already split into pipeline stages")
    kept = stage_layers(len(layers), stage_index, num_stages)
    decoder.layers = nn.ModuleDict({str(i): layers[i] for i in kept})
    if stage_index != 0:
        decoder.embed_tokens = None
    if stage_index != num_stages - 1:
        decoder.norm = None
        setattr(base, head_name(base), None)
    return PipelineStageModule(causal_lm, stage_index, num_stages, chunk)


def _pad(t: torch.Tensor, rows: int, length: int, value: int) -> torch.Tensor:
    out = t.new_full((rows, length), value)
    out[: t.size(0), : t.size(1)] = t
    return out


def padded_length(n: int) -> int:
    """`n` rounded up to a multiple of an eighth of the next power of two, at least 8 (9 -> 16,
    100 -> 112, 1000 -> 1024, 1025 -> 1280): fewer than 8 positions more up to 32, less than a
    quarter more above, four lengths per doubling, so a growing longest row rebuilds the pipeline
    schedule a few times only. Idempotent: a returned length maps to itself."""
    step = max(8, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // step) * step


class PipelineRunner:
    """Runs one rank's pipeline stage over all micro-batches of a step with the 1F1B schedule.

    Every rank of a pipeline group gets the same micro-batches (they share a data shard). A schedule
    infers its stage's shapes at its first step (a forward, FSDP2 all-gathers included, and one
    metadata exchange between stages) and then sends and receives fixed-shape buffers, so every
    micro-batch is padded to one shape ``[rows, length]``: padding tokens get id 0, label -100 (no
    target, so the loss is unchanged) and position 0 when rows carry position_ids. The shape is the
    largest rows and :func:`padded_length` of the longest row seen so far; a step that does not fit
    grows it and rebuilds the schedule, which every rank of a data group does at the same step
    (they see the same padded shapes, `runner.PipelineStepRunner._same_shape`). Training and
    evaluation keep one schedule each: torch 2.11 builds a stage's receive buffers with or
    without gradients once (a schedule first run by `eval` cannot train), 2.13 re-infers the
    shapes at each switch. 1F1B runs on gloo (CPU) and NCCL.

    Args:
        stage_module: this rank's :class:`PipelineStageModule` (possibly wrapped by FSDP2's
            `fully_shard`), on `device`.
        stage_index: this rank's stage.
        num_stages: the pipeline degree.
        pp_group: the process group of this rank's pipeline (``device_mesh["pipeline"].get_group()``).
        device: where the stage computes.
        n_microbatches: micro-batches per step; at least `num_stages` (1F1B).
        grad_divisor: the backward's loss is multiplied by this (`Strategy.grad_divisor`: FSDP2's
            reduce-scatter averages over the data ranks; the loss returned is not multiplied).

    Raises:
        ValueError: fewer micro-batches than stages.
    """

    def __init__(
        self,
        stage_module: nn.Module,
        stage_index: int,
        num_stages: int,
        pp_group: Any,
        device: torch.device,
        n_microbatches: int,
        grad_divisor: float = 1.0,
    ) -> None:
        if n_microbatches < num_stages:
            raise ValueError(f"1F1B needs at least as many micro-batches ({n_microbatches}) as stages ({num_stages})")
        self.module, self.stage_index, self.num_stages = stage_module, stage_index, num_stages
        self.group, self.device, self.n_microbatches = pp_group, torch.device(device), n_microbatches
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.grad_divisor = grad_divisor
        self._scale: torch.Tensor | None = None
        #: training (True) / evaluation (False) -> ((rows, length, packed), its schedule)
        self._built: dict[bool, tuple[tuple[int, int, bool], Any]] = {}

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The stage's forward returned the summed token loss; the schedule backpropagates this.
        assert self._scale is not None
        return output * self._scale

    def _schedule_for(self, needed: tuple[int, int, bool], training: bool) -> tuple[tuple[int, int, bool], Any]:
        """The (shape, schedule) a step of shape `needed` runs in: the mode's current one when the
        step fits in it, else a new one of the grown shape (the old one is dropped)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        rows, length, packed = needed
        built = self._built.get(training)
        if built is not None:
            have_rows, have_length, have_packed = built[0]
            if have_packed == packed and rows <= have_rows and length <= have_length:
                return built
            rows, length = max(rows, have_rows), max(length, have_length)
        shape = (rows, padded_length(length), packed)
        stage = PipelineStage(self.module, self.stage_index, self.num_stages, self.device, group=self.group)
        self._built[training] = (shape, Schedule1F1B(stage, self.n_microbatches, loss_fn=self._loss, scale_grads=False))
        return self._built[training]

    def _needed(self, micro_batches: list[dict]) -> tuple[int, int, bool]:
        """The rows, length and packing of this step's micro-batches (checked)."""
        if len(micro_batches) != self.n_microbatches:
            raise ValueError(f"expected {self.n_microbatches} micro-batches, got {len(micro_batches)}")
        packed = micro_batches[0].get("position_ids") is not None
        for mb in micro_batches:
            if (mb.get("position_ids") is not None) != packed:
                raise ValueError("a step's micro-batches must all be packed or all unpacked")
            mask = mb.get("attention_mask")
            if (
                not packed
                and mask is not None
                and mask.device.type == "cpu"
                and bool((mask[:, 1:] > mask[:, :-1]).any())
            ):
                raise ValueError("pipeline stages take right-padded rows only (a row's attention mask rises)")
        rows = max(mb["input_ids"].size(0) for mb in micro_batches)
        length = max(mb["input_ids"].size(1) for mb in micro_batches)
        return rows, length, packed

    def _inputs(
        self, micro_batches: list[dict], shape: tuple[int, int, bool]
    ) -> tuple[tuple, dict, torch.Tensor | None]:
        """The schedule's whole-batch args, kwargs and target: the micro-batches padded to `shape`
        and concatenated along rows (the schedule splits them back into `n_microbatches`)."""
        rows, length, packed = shape
        ids = [_pad(mb["input_ids"], rows, length, 0) for mb in micro_batches]
        # position_ids go to every stage (each builds its mask and rotary embedding), labels to the last.
        kwargs: dict = {}
        if packed:
            positions = [_pad(mb["position_ids"], rows, length, 0) for mb in micro_batches]
            kwargs["position_ids"] = torch.cat(positions).to(self.device)
        target = None
        if self.is_last:
            labels = [_pad(mb["labels"], rows, length, IGNORE_INDEX) for mb in micro_batches]
            target = kwargs["labels"] = torch.cat(labels).to(self.device)
        args = (torch.cat(ids).to(self.device),) if self.is_first else ()
        return args, kwargs, target

    def step(self, micro_batches: list[dict], denominator: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this step's micro-batches through the pipeline; gradients
        accumulate in the stage's parameters (no optimizer step).

        Args:
            micro_batches: `n_microbatches` dicts with ``input_ids`` and ``labels`` [rows, T]
                (unshifted, -100 where not trained), optional ``attention_mask`` (right padding
                only) and ``position_ids`` (packed rows), the same on every rank of the pipeline.
            denominator: 0-dim float32, the global batch's target-token count (all-reduced over
                the data ranks beforehand); each micro-batch's summed token loss is divided by it.

        Returns:
            0-dim float32: on the last stage the sum of the micro-batches' divided losses, 0 elsewhere
            (all-reduce it over `pp_group` to have it everywhere).

        Raises:
            ValueError: not `n_microbatches` micro-batches, packed and unpacked ones mixed, or
                left-padded rows.
        """
        shape, schedule = self._schedule_for(self._needed(micro_batches), training=True)
        args, kwargs, target = self._inputs(micro_batches, shape)
        self._scale = self.grad_divisor / denominator.to(self.device, torch.float32)
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        self._scale = None
        if self.is_last:
            return torch.stack([loss.detach() for loss in losses]).sum() / self.grad_divisor
        return torch.zeros((), dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def forward_only(self, micro_batches: list[dict]) -> torch.Tensor:
        """Forward of `n_microbatches` micro-batches (as in :meth:`step`), no backward.

        Returns:
            0-dim float32: on the last stage the summed token loss of all micro-batches (not divided),
            0 elsewhere.
        """
        shape, schedule = self._schedule_for(self._needed(micro_batches), training=False)
        args, kwargs, target = self._inputs(micro_batches, shape)
        self._scale = torch.ones((), device=self.device)
        losses: list[torch.Tensor] = []
        schedule.eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        self._scale = None
        if self.is_last:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros((), dtype=torch.float32, device=self.device)


def pipeline_grad_norm(params: Iterable[torch.Tensor], pp_group: Any, norm_type: float = 2.0) -> torch.Tensor:
    """The total gradient norm over every pipeline stage (and every shard of each stage).

    Each stage's norm comes from `tensor.grad_norm_and_clip` (DTensor gradients made whole
    over their data / tensor meshes by `full_tensor`); the stages' norms are combined over `pp_group`:
    ``sqrt(all_reduce_sum(norm_s ** 2))`` for p = 2, their maximum for p = inf.

    Args:
        params: this stage's trainable parameters.
        pp_group: this rank's pipeline process group.
        norm_type: 2.0 or inf.

    Returns:
        0-dim float32 plain tensor, the same on every rank.

    Raises:
        ValueError: another norm type.
    """
    from scaletune.strategies.parallel.tensor import grad_norm_and_clip

    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"pipeline gradient norm: p = {norm_type} is not supported (2 or inf)")
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    norm = grad_norm_and_clip(params, float("inf"), norm_type).to(device, torch.float32)
    if norm_type == 2.0:
        total = norm.square()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        return total.sqrt()
    dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
    return norm


def pipeline_clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, pp_group: Any, norm_type: float = 2.0
) -> torch.Tensor:
    """:func:`pipeline_grad_norm`, then every gradient scaled by torch's `clip_grads_with_norm_`
    (coefficient max_norm / (total + 1e-6), at most 1) with the total over all stages.

    Returns:
        0-dim float32: the total norm before clipping, the same on every rank.
    """
    from torch.distributed.tensor import DTensor, Replicate

    params = [p for p in params if p.grad is not None]
    total = pipeline_grad_norm(params, pp_group, norm_type)
    if max_norm == float("inf") or not params:
        return total
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    for mesh, group in groups.items():
        # foreach ops refuse mixing DTensors and plain tensors: the total replicated on each mesh.
        norm = total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return total

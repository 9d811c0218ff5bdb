"""The causal-LM loss as a module, so every engine wraps model and loss together.

`CausalLMLoss` runs the decoder, then the output head and cross-entropy only at positions that
have a target, in chunks under activation checkpointing: the full `[tokens, vocab]` logits are
never materialised (in fp32 or at all), which dominates memory and time for large vocabularies
(OLMo-2: 100k; Llama-3: 128k). The same idea as Liger's fused linear cross-entropy
(Hsu et al. 2024, arXiv:2410.10989) and torchtune's chunked output loss, in plain PyTorch.

It sits inside the DDP/FSDP/DeepSpeed wrapper, so the head's parameters are gathered and its
gradients reduced by the engine's own forward hooks.

Two options (`model.activation_offload`, `model.liger`), both off by default:

* activation offload: the decoder runs under `torch.autograd.graph.save_on_cpu`, so the tensors
  autograd saves for backward wait in host memory;
* Liger (CUDA only): the head and loss are Liger's fused linear cross-entropy kernel instead of
  the chunked PyTorch path (the model-level Liger kernels are applied by `models.prepare_model`).

A tensor-parallel head (vocabulary-sharded DTensor logits) gets :func:`vocab_parallel_cross_entropy`.
The loss imports nothing from `strategies/`: a strategy shapes the model (shards the head, splits
the rows), and the loss reads what it is handed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletune.models.attention import causal_sdpa, context_mask, full_causal_only, packed_mask
from scaletune.models.introspection import unwrap
from scaletune.resolve.mesh import head_transforms_logits

IGNORE_INDEX = -100
CUDA_CHUNK = 1024  # target rows per head+loss chunk on a GPU: [1024, vocab] logits at a time
CPU_CHUNK_BYTES = 24 * 2**20  # one fp32 logits chunk on the CPU stays under this


def default_chunk(vocab_size: int, device: torch.device) -> int:
    """Target rows per head+loss chunk.

    CUDA: 1024 rows; the caching allocator hands the same block back for every chunk. CPU: as many
    rows as keep one fp32 ``[rows, vocab]`` chunk under 24 MiB, because glibc's malloc serves blocks
    below its mmap threshold (adaptive, at most 32 MiB on 64-bit: DEFAULT_MMAP_THRESHOLD_MAX, see
    mallopt(3)) from reused heap memory, while every larger block is a fresh mmap whose pages fault
    in zeroed. Measured here (2 cores, vocab 100,352, 1,000 targets, forward + backward): 1,024 rows
    1,619 ms with 588k page faults; 64 rows 883 ms with none; 16 rows 1,424 ms (too small a matmul).

    Args:
        vocab_size: columns of the logits (the head's out_features).
        device: where the logits are computed.
    """
    if device.type == "cuda":
        return CUDA_CHUNK
    return max(16, CPU_CHUNK_BYTES // (4 * vocab_size))


def target_index(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of positions t whose next token labels[t+1] is a target.

    Computed on the host before the batch moves, so the step needs no device-to-host sync.

    Args:
        labels: [batch, seq] unshifted labels (-100 where not trained).

    Returns:
        [num_targets] int64 indices into the flattened [batch * (seq - 1)] shifted positions.
    """
    return (labels[:, 1:].reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


# The cross-entropy of a tensor-parallel head: the strategy shards the head over the vocabulary
# (strategies.parallel.tensor), the loss takes the sum over the shards here.


@contextlib.contextmanager
def _loss_parallel() -> Iterator[None]:
    """torch's `loss_parallel()`, entered only where it is not on already: it swaps DTensor's op
    handlers globally, and an inner exit would switch them off under an outer context."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    if torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers:
        yield
        return
    with loss_parallel():
        yield


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward and backward of the summed cross-entropy under torch's `loss_parallel()`, which torch
    requires of both; the trainer's backward runs outside any such context, so the gradient is
    computed here, in this function's backward, by a second (cheap) pass over the logits shard."""

    @staticmethod
    def forward(ctx, logits, targets):  # noqa: D102 - see the class
        ctx.save_for_backward(logits, targets)
        with _loss_parallel():
            return F.cross_entropy(logits, targets, reduction="sum").to_local()

    @staticmethod
    def backward(ctx, grad_total):  # noqa: D102
        from torch.distributed.tensor import DTensor

        logits, targets = ctx.saved_tensors  # first: under a checkpoint this recomputes the forward
        with torch.enable_grad(), _loss_parallel():
            leaf = logits.detach().requires_grad_()
            loss = F.cross_entropy(leaf, targets, reduction="sum")
            grad_out = DTensor.from_local(grad_total, loss.device_mesh, loss.placements, run_check=False)
            (grad,) = torch.autograd.grad(loss, leaf, grad_out)
        return grad, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum_i CE(logits_i, targets_i) for logits sharded over the vocabulary on a one-dimensional mesh.

    torch's `loss_parallel()` cross-entropy: each rank's log-softmax takes the max and the sum of
    exponentials all-reduced over the vocabulary shards (Megatron-LM's vocab-parallel cross-entropy,
    Shoeybi et al. 2019, arXiv:1909.08053), so the full logits never exist on one rank. Safe inside
    `torch.utils.checkpoint` (non-reentrant) and in a backward outside any `loss_parallel()` context.

    Args:
        logits: [n, vocab] float DTensor, `Shard(-1)` (the head of `strategies.parallel.tensor.apply_tensor_parallel`).
        targets: [n] int64 plain tensor of token ids, the same on every rank of the mesh.

    Returns:
        0-dim plain float tensor, the total over the n rows, the same on every rank.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets)


def _head_ce_sum(hidden: torch.Tensor, weight_holder: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    logits = weight_holder(hidden).float()  # a device_map hook may move the input to the head's own device
    if hasattr(logits, "full_tensor"):  # a DTensor: a tensor-parallel head's vocab-sharded logits
        return vocab_parallel_cross_entropy(logits, targets.to(logits.device))
    return F.cross_entropy(logits, targets.to(logits.device), reduction="sum")


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with `acc` float32 and `a`, `b` in the compute dtype.

    CUDA: one cuBLAS call that accumulates into the fp32 buffer (`addmm` with `out_dtype`), so the
    chunk's product is never rounded to bf16 nor held as a bf16 and an fp32 temporary. Elsewhere
    (no such kernel on the CPU): the product in the compute dtype, upcast, added.
    """
    global _ADDMM_OUT_DTYPE
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.device.type == "cuda" and _ADDMM_OUT_DTYPE:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_OUT_DTYPE = False  # a torch or GPU without the kernel (aten::addmm.dtype_out)
    acc += (a @ b).to(acc.dtype)


_ADDMM_OUT_DTYPE = True


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, targets_i) with both gradients computed in the forward.

    Chunk by chunk: logits (fp32), their log-sum-exp and the loss; then, in the same buffer,
    d loss / d logits = softmax - one_hot(target), and from it d/d hidden (into [n, hidden]) and
    d/d weight (accumulated in fp32). Backward only scales them by the incoming gradient. Against
    checkpointing the chunk and running autograd's backward, this skips the recomputed head matmul
    (a quarter of the head's matmul FLOPs) and the log-softmax passes over [chunk, vocab]. The scheme is
    Liger's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989) in plain PyTorch.
    Holds one fp32 [vocab, hidden] gradient from forward to backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, compute_dtype):  # noqa: D102 - see the class
        need_h, need_w = hidden.requires_grad, weight.requires_grad
        w = weight.to(compute_dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), chunk):
            h = hidden[start : start + chunk].to(compute_dtype)
            y = targets[start : start + chunk]
            logits = (h @ w.t()).float()  # [c, vocab]
            lse = torch.logsumexp(logits, dim=1)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if need_h or need_w:
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' buffer
                grad[torch.arange(y.numel(), device=y.device), y] -= 1.0
                g = grad.to(compute_dtype)
                if need_h:
                    grad_h[start : start + chunk] = g @ w
                if need_w:
                    _accumulate_mm(grad_w, g.t(), h)
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: D102
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        return (
            None if grad_h is None else grad_h * grad_total.to(grad_h.dtype),
            None if grad_w is None else grad_w * grad_total.to(grad_w.dtype),
            None,
            None,
            None,
        )


def _fusable(head: nn.Module, partitioned: bool) -> bool:
    """A plain Linear head without bias whose weight is whole here. Not: a head whose weight the engine partitions
    outside its forward (DeepSpeed ZeRO-3) or shards (tensor parallelism: a DTensor), peft-wrapped or quantized heads
    (whose forward is not `x @ weight.T`), a head offloaded by a device_map (accelerate's hook brings its weight in
    from the CPU or disk only inside its forward; outside it the weight is on the meta device)."""
    return (
        type(head) is nn.Linear
        and head.bias is None
        and not partitioned
        and getattr(head, "_hf_hook", None) is None
        and not (head.weight.device.type == "meta" or hasattr(head.weight, "full_tensor"))
    )


def chunked_head_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int | None = None, *, partitioned: bool = False
) -> torch.Tensor:
    """sum_i CE(head(hidden[i]), targets[i]) without holding more than `chunk` rows of logits.

    A plain `nn.Linear` head goes through :class:`_LinearCrossEntropy` (gradients computed in the
    forward); any other head (LoRA on the head, quantized) is called as a module on each chunk
    under activation checkpointing, so its hooks and forward run as usual. A head partitioned by
    DeepSpeed ZeRO-3 is called once on all rows, checkpointed, on every rank (see the code).

    Args:
        hidden: [n, hidden_size] final hidden states at target positions.
        head: the output projection (`lm_head`), hidden_size -> vocab.
        targets: [n] int64 token ids.
        chunk: rows per chunk (default :func:`default_chunk`).
        partitioned: the engine gathers the head's weight inside each call of the head (DeepSpeed
            ZeRO-3, `Strategy.partitions_head`).

    Returns:
        0-dim float32 sum of the token losses (0 when n == 0, still connected to the graph).
    """
    n = hidden.size(0)
    if partitioned:
        # DeepSpeed ZeRO-3 gathers the head's weight in a collective at every call of the head, and
        # again when a checkpoint recomputes that call in backward, so every rank must make the same
        # calls whatever its number of targets (unequal calls deadlock): one checkpointed call per
        # micro-batch, also with no target at all. This rank's logits are then held whole in the
        # forward; the checkpoint frees them until backward.
        if torch.is_grad_enabled():
            return checkpoint(_head_ce_sum, hidden, head, targets, use_reentrant=False)
        return _head_ce_sum(hidden, head, targets)
    if n == 0:
        # Run the head on the empty batch rather than skipping it: its forward hooks still fire
        # (ZeRO-3 gathers the weight on every rank together, or the others would wait forever) and
        # its weight gets a zero gradient, so DDP sees every parameter used.
        return _head_ce_sum(hidden, head, targets)
    if chunk is None:
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]  # out_features survives ZeRO-3 partitioning
        chunk = default_chunk(vocab, hidden.device)
    if _fusable(head, partitioned):
        # A device_map may put the head on another GPU than the last layer (a tied head sits with the
        # embeddings on the first): the rows go to the weight, differentiably.
        hidden, targets = hidden.to(head.weight.device), targets.to(head.weight.device)
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else head.weight.dtype
        if torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad):
            return _LinearCrossEntropy.apply(hidden, head.weight, targets, chunk, dtype)
        with torch.no_grad():
            return _LinearCrossEntropy.apply(hidden.detach(), head.weight.detach(), targets, chunk, dtype)
    total = None
    for start in range(0, n, chunk):
        h, y = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            part = checkpoint(_head_ce_sum, h, head, y, use_reentrant=False)
        else:
            part = _head_ce_sum(h, head, y)
        total = part if total is None else total + part
    return total


def liger_head_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *, partitioned: bool = False
) -> torch.Tensor:
    """sum_i CE(head(hidden[i]), targets[i]) by Liger's fused linear cross-entropy (CUDA, Triton).

    Liger-Kernel (Hsu et al. 2024, arXiv:2410.10989; https://github.com/linkedin/Liger-Kernel)
    `LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum")`: the head's matmul and
    the loss run chunk by chunk in one kernel, gradients computed during the forward, so neither
    the logits nor their gradient are held whole.

    The kernel takes `head.weight` as a tensor, outside the head's forward: fine where the weight
    is whole there (single, DDP, ZeRO-1/2, and FSDP2, whose root unit here holds the head), not
    under DeepSpeed ZeRO-3 (rejected by the config check and again here).

    Args:
        hidden: [n, hidden_size] final hidden states at target positions (on a CUDA device).
        head: the output projection (`lm_head`), an `nn.Linear` hidden_size -> vocab.
        targets: [n] int64 token ids.
        partitioned: the engine partitions the head's weight outside its forward (ZeRO-3).

    Returns:
        0-dim float32 sum of the token losses.

    Raises:
        RuntimeError: the head's weight is partitioned by DeepSpeed ZeRO-3.
    """
    weight, bias = head.weight, getattr(head, "bias", None)
    if partitioned:
        from scaletune.resolve.rules import liger_problem  # the rule resolve refuses the config by

        problem = liger_problem(True, True)
        assert problem is not None
        raise RuntimeError(problem.text())
    if hidden.size(0) == 0:
        return _head_ce_sum(hidden, head, targets)  # as the chunked path: hooks fire, zero gradient
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    # Do what autocast does to a Linear (both operands in the autocast dtype), then run the kernel
    # with autocast off: Liger releases have failed on mixed bf16/fp32 operands under AMP
    # (linkedin/Liger-Kernel#305, #501). The casts are differentiable, so fp32 master weights train.
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with torch.autocast(device_type, enabled=False):
        # accum_dtype float32: the weight (and bias) gradient is accumulated over chunks in fp32, not
        # in the compute dtype (liger-kernel >= 0.6.2; the floor in pyproject.toml is 0.7.0, the
        # first release for transformers 5). Liger itself syncs once per call (the `.item()` of its
        # target count, ops/fused_linear_cross_entropy.py); this is called once per micro-batch.
        out = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=torch.float32)(
            weight.to(dtype),
            hidden.to(weight.device, dtype),
            targets.to(weight.device),
            None if bias is None else bias.to(dtype),
        )
    loss = out if isinstance(out, torch.Tensor) else out[0]  # newer releases may return (loss, extras)
    return loss.float()


def decoder_and_head(causal_lm: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the module whose forward returns the last hidden state, the output head). For a
    vision-language model the first is its multimodal base model, which merges the image features
    into the text's embeddings before its language model (`models.vision.multimodal_base`)."""
    from scaletune.models.vision import is_vision_language, multimodal_base

    base = unwrap(causal_lm)  # under peft
    if is_vision_language(getattr(base, "config", None)):
        return multimodal_base(base), base.get_output_embeddings()
    return base.get_decoder(), base.get_output_embeddings()


class CausalLMLoss(nn.Module):
    """Wraps a Hugging Face causal LM (or a peft model around one) and returns the summed token loss.

    forward(input_ids [B,T], labels [B,T] unshifted, target_index [n] from :func:`target_index`,
    attention_mask [B,T] | None, position_ids [B,T] | None) -> 0-dim float32 sum of the
    next-token cross-entropy over every target position. Rows are right-padded, as
    `data.batching.Collator` pads them: with an `attention_mask` (unpacked rows) and a model of
    plain causal layers, the mask and position_ids are not passed on (they change nothing the loss
    reads; without them attention runs causal-only).

    LoRA layers are injected in place by peft, so running the decoder of the base model runs them.

    Args:
        causal_lm: the model (`AutoModelForCausalLM`, or a peft model around one).
        chunk: target positions per head+loss chunk of the PyTorch path.
        activation_offload: run the model's forward under
            `torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())` (PyTorch's
            saved-tensor hooks; the idea of torchtune's activation offloading,
            `torchtune.training.OffloadActivations`): every tensor autograd saves for backward is
            copied to host memory as it is saved and back to the device when backward needs it,
            so the device holds about one layer's saved activations at a time instead of every
            layer's (for long sequences), paid for with host-device copies (into pinned memory
            where CUDA is available, so they can run asynchronously). With gradient checkpointing
            only the layer boundaries are saved, so only those move.
            Unlike torchtune's version, save_on_cpu also copies the weights that matmuls save
            (and, under autocast, their low-precision copies), which adds traffic per layer.
            Results are bit-identical to running without it.
        liger: compute head and loss with :func:`liger_head_cross_entropy` (Liger's fused linear
            cross-entropy; CUDA and liger-kernel needed, checked here) instead of
            :func:`chunked_head_cross_entropy`. Heads that transform logits keep the model's own
            forward either way.
        partitioned_head: the engine gathers the head's weight inside each call of the head
            (DeepSpeed ZeRO-3, `Strategy.partitions_head`): the head is then called once per
            micro-batch, since every rank must call it equally often.

    Raises:
        RuntimeError: `liger` without a CUDA GPU or without liger-kernel installed.
    """

    def __init__(
        self,
        causal_lm: nn.Module,
        chunk: int | None = None,
        *,
        activation_offload: bool = False,
        liger: bool = False,
        partitioned_head: bool = False,
    ) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.chunk = chunk
        self.activation_offload = activation_offload
        self.liger = liger
        self.partitioned_head = partitioned_head
        if liger:
            from scaletune.models import require_liger

            require_liger()
        # Heads that transform logits (Gemma-2 soft-capping, Cohere's logit scale) keep the
        # model's own forward: computing the head here would skip that transform.
        self.plain = head_transforms_logits(getattr(causal_lm, "config", None))

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """The causal LM's `generate` (transformers; `kwargs` as it takes them): [rows, prompt +
        new tokens]. Called through this module so that an engine whose hooks sit on it (FSDP2's
        root unit holds the embeddings and the head: `register_fsdp_forward_method`) runs them
        around the whole call."""
        return self.causal_lm.generate(**kwargs)

    def _saved_tensors_context(self) -> contextlib.AbstractContextManager:
        if not self.activation_offload:
            return contextlib.nullcontext()
        # Pinned host memory needs the CUDA runtime; without it plain host memory does the same job.
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())

    @contextlib.contextmanager
    def _forward_context(self, causal: bool) -> Iterator[None]:
        """The model's forward runs inside: activation offloading, and :func:`causal_sdpa` for rows
        that need no mask."""
        attention = causal_sdpa(self.causal_lm.config) if causal else contextlib.nullcontext()
        with attention, self._saved_tensors_context():
            yield

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        target_index: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        full_position_ids: torch.Tensor | None = None,
        **images: torch.Tensor,
    ) -> torch.Tensor:
        """A context slice (`strategies.parallel.context.split_batch`): labels [B, L + 1] for input_ids
        [B, L], every position scored against ``labels[:, 1:]``; attention over whole rows, causal or
        by ``full_position_ids`` (packed); ``attention_mask`` (the slice's padding) unused.

        ``images``: a vision-language model's image tensors (`models.vision.IMAGE_INPUTS`: their
        shapes are the processor's), passed to its forward beside the text."""
        context = labels.size(1) == input_ids.size(1) + 1
        causal = False
        if context:
            attention_mask = context_mask(self.causal_lm.config, full_position_ids)
        elif attention_mask is None and position_ids is not None:
            # Packed rows (the collator gives them no 2D mask): their mask once per micro-batch,
            # handed to transformers as 4D so it skips its own per-forward mask work and host sync.
            attention_mask = packed_mask(self.causal_lm.config, position_ids)
        elif attention_mask is not None and full_causal_only(self.causal_lm.config):
            # Unpacked rows, right-padded (the Collator's): under causal attention a real token never
            # sees the padding after it, so the padding mask changes nothing the loss reads (the pads'
            # labels are -100), and real tokens' positions are 0..n-1 either way. Without the mask and
            # the pads' restarting position_ids (which would read as packed rows), SDPA runs
            # `is_causal` (the flash kernel, no [B, 1, T, T] mask) and transformers skips its mask
            # build and its host sync (`padding_mask.all()` in `_ignore_causal_mask_sdpa`) every
            # micro-batch; `causal_sdpa` spares it transformers' packed-rows check too.
            attention_mask = position_ids = None
            causal = True
        scored = slice(None) if context else slice(None, -1)
        if self.plain:
            with self._forward_context(causal):
                logits = self.causal_lm(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                    **images,
                ).logits
            index = target_index.to(logits.device)
            flat = logits[:, scored, :].reshape(-1, logits.size(-1)).index_select(0, index).float()
            targets = labels[:, 1:].reshape(-1).to(logits.device).index_select(0, index)
            return F.cross_entropy(flat, targets, reduction="sum").to(input_ids.device)
        decoder, head = decoder_and_head(self.causal_lm)
        # Only the decoder's activations are offloaded: the head's chunks are recomputed in
        # backward anyway, and their inputs are the few target rows gathered below.
        with self._forward_context(causal):
            out = decoder(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **images
            )
        hidden = out.last_hidden_state[:, scored, :]
        # With a device_map over several GPUs the last hidden state is on the last one, the batch on
        # the first: the indices follow the hidden state, and the loss returns to the batch's device.
        index = target_index.to(hidden.device)
        hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, index)
        targets = labels[:, 1:].reshape(-1).to(hidden.device).index_select(0, index)
        if self.liger:
            loss = liger_head_cross_entropy(hidden, head, targets, partitioned=self.partitioned_head)
        else:
            loss = chunked_head_cross_entropy(hidden, head, targets, self.chunk, partitioned=self.partitioned_head)
        return loss.to(input_ids.device)

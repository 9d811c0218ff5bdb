"""Activation bytes of one micro-batch on one rank, with or without a device mesh.

Per decoder layer the count follows Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1:
`sbh(34 + 5as/h)` bytes for a GPT layer with 16-bit activations), adapted to the architectures
scaletune trains: no dropout (no masks), RMSNorm (its input kept: 2 norms x sbh), grouped-query
attention (K and V are `h_kv = n_kv x head_dim` wide), fused attention (SDPA / flash: the output
and a fp32 logsumexp per head, no s^2 terms; `eager` keeps the 2-byte a s^2 b softmax), and a
SwiGLU MLP of width i (input, gate, SiLU(gate), up, product: sbh + 4 sbi). In elements:
`sbh (6 + 2 h_kv / h) + 4 sbi` per layer, times the activation width (2 bytes bf16/fp16, 4 fp32); the residual
stream's part (`2 sbh` norm inputs, a checkpointed layer's input, the edges) is fp32 where single/ddp autocast a full
fine-tune (`residual_bytes`; tiny OLMo-2 measured: 4h bytes a token and layer more than under `bf16_params`).
LoRA adds each adapter's `x A` (s b r) and, with `lora.dropout > 0`, the dropped-out input and its
1-byte mask per target module. With gradient checkpointing (non-reentrant, per decoder layer) a
layer keeps only its input (sbh) and one layer is recomputed at a time: `L sbh + one layer`.
The loss (`loss.py`) never builds `[tokens, vocab]` logits: one chunk of 1024 target rows is
alive, in the compute dtype, as fp32, its log-softmax and its gradient (`1024 V (b_c + 12)`).

The device mesh (tensor degree t, context degree c; `plan/mesh.py`):

* Tensor parallelism without sequence parallelism (Korthikanti et al. 2022, section 4.2, eq. 2:
  `sbh(10 + 24/t + 5as/(ht))`): what the column-parallel projections read (the norms' inputs and
  outputs, the residual stream, the edges) stays whole on every tensor rank; the projections'
  outputs (Q, K, V, the attention output, the MLP's gate/up/product) and the attention's per-head
  terms are split t ways. Where the model's plan gathers the q/k/v outputs (`colwise_gather_output`:
  OLMo-2, whose q/k norms span all heads) Q, K, V, the attention output and the per-head terms stay
  whole on every tensor rank. The output head is split over the vocabulary, so a loss chunk holds
  `V / t` columns (`models/loss.py` chunks a tensor-parallel head as any other: 1024 rows at a time).
* Context parallelism, DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509, section 3): every
  tensor outside attention holds `s / c` positions. Around attention an all-to-all trades the
  sequence split for a head split: attention runs on the whole sequence `s` for `a / (t c)` heads.
  An all-to-all keeps a rank's element count (`s/c x a/t = s x a/(t c)` head-positions), so Q, K,
  V and the output are `1/c` of the single-rank size, as is the fp32 logsumexp (`4 s b a / (t c)`
  bytes). `strategies/parallel/context.py` always attends through sdpa, so there are no `s^2`
  scores even where the model was loaded `eager` (an eager kernel on a head subset would hold
  `2 (a / (t c)) s^2 b` bytes: the full `s^2` per head, not `(s/c)^2`).
* Packed rows under sdpa, and every packed row under context parallelism, carry one dense bool
  `[b, 1, s, s]` document mask (`models.attention.packed_mask`, over the whole rows), `b s^2`
  bytes shared by every layer; SDPA's fused kernels take a float bias, so each attention call
  turns the mask into one (`b s^2 p` bytes, the compute dtype) and keeps it for its backward: one
  layer's under checkpointing (the layer recomputed), every layer's without. At 131,072 tokens a
  row that is 16 GiB of mask and 32 GiB of bias a layer in bf16: context parallelism refuses
  packed rows above `resolve.mesh.MAX_PACKED_CONTEXT_LENGTH`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletune.plan.reference_model import sequences_per_example
from scaletune.plan.shapes import ModelShape, VisionShape
from scaletune.resolve import FLOAT_DTYPES

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec

#: Target rows of one head+loss chunk on a GPU (`loss.CUDA_CHUNK`).
LOSS_CHUNK = 1024

#: Images a row holds, for a vision tower's activations: the planner reads the config, not the
#: data (a record may hold several images, and Idefics3's processor may split one into tiles).
IMAGES_PER_ROW = 1


def residual_bytes(spec: RunSpec, plan_entry: str) -> int:
    """Bytes per element of the residual stream under the plan entry's engine: 4 where single/ddp autocast over fp32
    weights (embeddings, norms and adds in fp32), else the compute dtype's (the engine or `bf16_params` cast them)."""
    m, compute = spec.config.model, spec.precision.compute
    autocast_fp32 = compute != "float32" and m.lora is None and m.mixed_precision == "autocast"
    return 4 if plan_entry.removesuffix("-offload") == "ddp" and autocast_fp32 else FLOAT_DTYPES[compute][0]


def _lora_per_layer(modules: list[tuple[int, int]], tokens: int, p: int, dropout: bool) -> int:
    """LoRA's saved tensors in one layer: `x A` (tokens x r, whole on every tensor rank) and, with
    dropout, the dropped-out input and its mask, per (input features on this rank, r) adapter."""
    return sum(tokens * r * p + (tokens * d_in * (p + 1) if dropout else 0) for d_in, r in modules)


def activation_bytes(
    shape: ModelShape,
    spec: RunSpec,
    *,
    checkpointing: bool,
    residual: int | None = None,
    seq_len: int | None = None,
    tensor: int = 1,
    context: int = 1,
    heads: int | None = None,
    lora_modules: list[tuple[int, int]] | None = None,
) -> int:
    """Activation bytes of one micro-batch on one rank (see the module docstring).

    Args:
        shape: the model (a factory's model: what its meta forward saved, `ModelShape.activations`,
            whatever the other arguments).
        spec: the run (micro-batch, precision, attention, LoRA); a micro-batch of preference pairs
            is 2 sequences a pair.
        checkpointing: per-layer activation checkpointing.
        residual: :func:`residual_bytes` (default: the compute dtype's).
        seq_len: tokens per sequence (default: the first stage's `max_seq_length`).
        tensor: tensor-parallel degree t (1: none).
        context: context-parallel degree c (1: none); a rank holds `ceil(s / c)` positions.
        heads: the tensor ranks the attention's heads are split over (default `tensor`; 1 where
            the q/k/v outputs are gathered, `mesh.TensorLayout.splits_heads`).
        lora_modules: (input features on this rank, r) of every adapter in ONE layer (default:
            `shape.lora_modules`, whole).

    Returns:
        Bytes, an int.
    """
    if shape.activations is not None:
        return shape.activations
    cfg = spec.config
    s = seq_len or spec.batch.max_seq_length
    b = spec.batch.micro_batch_size * sequences_per_example(spec)  # pairs: 2 rows
    tokens = -(-s // context) * b  # positions this rank holds outside attention
    h, i, L, t = shape.hidden, shape.intermediate, shape.layers, tensor
    ht = tensor if heads is None else heads
    p = FLOAT_DTYPES[spec.precision.compute][0]
    rw = residual or p  # the residual stream's width
    h_kv = shape.kv_heads * shape.head_dim
    q_width = shape.heads * shape.head_dim
    whole = tokens * (2 * h * rw + 2 * h * p)  # norm inputs (rw) and outputs (p): whole on every tensor rank
    per_layer = whole + tokens * p * (2 * q_width + 2 * h_kv) // ht + tokens * p * 4 * i // t
    impl = cfg.model.attn_implementation or "sdpa"
    if impl == "eager" and context == 1:
        per_layer += 2 * shape.heads * s * s * b * p // ht  # scores (softmax output) and the attention over V
    else:  # fused attention; context parallelism always runs sdpa (`strategies/parallel/context.py`)
        per_layer += 4 * shape.heads * tokens // ht  # logsumexp per head, fp32
    lora = cfg.model.lora
    if lora is not None:
        per_layer += _lora_per_layer(
            shape.lora_modules if lora_modules is None else lora_modules, tokens, p, lora.dropout > 0
        )
    # Packed rows under sdpa (and under context parallelism, which attends over whole rows) carry
    # one dense bool [b, 1, s, s] document mask (`models.attention.packed_mask`), shared by every
    # layer, and each layer's SDPA call a float bias made from it, saved for its backward.
    packed = spec.stages[0].data.packing if spec.stages else cfg.data.packing
    masked = packed and (context > 1 or impl == "sdpa")
    mask, bias = (b * s * s, b * s * s * p) if masked else (0, 0)
    loss = min(LOSS_CHUNK, tokens) * (-(-shape.vocab // t)) * (p + 12)
    edges = tokens * h * rw * 2  # embedding output, final norm input/output at the targets
    vision = vision_bytes(shape.vision, b * IMAGES_PER_ROW, p, rw, checkpointing=checkpointing, eager=impl == "eager")
    if checkpointing:
        return L * tokens * h * rw + per_layer + bias + loss + edges + mask + vision
    return L * (per_layer + bias) + loss + edges + mask + vision


def vision_bytes(vision: VisionShape | None, images: int, p: int, rw: int, *, checkpointing: bool, eager: bool) -> int:
    """Activation bytes of a vision-language model's vision tower over `images` images (0 for a
    frozen tower: its forward records nothing for backward). A ViT layer (SigLIP, CLIP: LayerNorm,
    attention, a GELU MLP of width i) over n = images x positions positions keeps, as a decoder
    layer does: the norms' inputs (`rw` wide) and outputs, Q, K, V and the attention output, the
    MLP's first projection and its GELU (`n (2 h rw + 6 h p + 2 i p)` bytes), a fp32 logsumexp per
    head (fused attention) or the `2 a n_img^2 p` scores (eager); with checkpointing (every layer of
    the tower recomputes, as the language model's do) its layers keep their inputs and one layer is
    alive. Around the layers: the pixels the patch embedding saves, the embeddings' output and the
    last norm's input. Measured on the CPU (`tests/unit/plan/test_vision_activations.py`)."""
    if vision is None or not vision.trains:
        return 0
    n, h = images * vision.positions, vision.hidden
    per_layer = n * (2 * h * rw + 6 * h * p + 2 * vision.intermediate * p)
    per_layer += 2 * vision.heads * images * vision.positions**2 * p if eager else 4 * vision.heads * n
    edges = images * vision.pixels * p + 2 * n * h * rw
    if checkpointing:
        return vision.layers * n * h * rw + per_layer + edges
    return vision.layers * per_layer + edges

"""The device mesh of a run: its degrees decided once from `distributed.tensor_parallel`,
`context_parallel` and `pipeline_parallel` (data parallelism is the rest of the world size), and
every rule about them: the config's here (:func:`mesh_problems`), the model's shape where the model
is known (:func:`model_mesh_problems`: the doctor, the planner and the run's start)."""

from __future__ import annotations

from typing import Any

from scaletune.errors import Problem
from scaletune.resolve.spec import Mesh, RunSpec

# What the model-parallel layouts are built for (strategies/parallel/tensor.py, context.py, pipeline.py).
MESH_STRATEGY = "fsdp"
DEGREE_KEYS = ("tensor_parallel", "context_parallel", "pipeline_parallel")
# Packed rows under context parallelism attend over whole rows with a dense [B, 1, T, T] document
# mask (`models.attention.context_mask`), which SDPA turns into a float bias in every layer (the
# planner counts both: plan/activations.py). At 32,768 tokens that is 3 GiB a row in bf16 (one
# layer's bias with the mask); twice the length, four times that.
MAX_PACKED_CONTEXT_LENGTH = 32768


def head_transforms_logits(hf_config: Any) -> bool:
    """True when a model's head transforms its logits (Gemma-2's `final_logit_softcapping`, Cohere's
    `logit_scale`): code that computes the head itself (the chunked loss, the vocabulary-parallel
    loss, a pipeline's last stage) would skip that transform. A vision-language model's is its
    language model's (`get_text_config`)."""
    if hasattr(hf_config, "get_text_config"):
        hf_config = hf_config.get_text_config()
    return bool(getattr(hf_config, "final_logit_softcapping", None) or getattr(hf_config, "logit_scale", None))


def mesh_for(distributed: Any, world_size: int) -> Mesh:
    """The mesh of `world_size` ranks with the configured degrees; `data_shard` is the quotient
    (floor: :func:`mesh_problems` judges a remainder, so deciding never fails on bad input)."""
    rest = distributed.tensor_parallel * distributed.context_parallel * distributed.pipeline_parallel
    return Mesh(
        pipeline=distributed.pipeline_parallel,
        data_shard=max(1, world_size // rest),
        context=distributed.context_parallel,
        tensor=distributed.tensor_parallel,
    )


def _p(key: str, message: str, fix: str = "") -> Problem:
    return Problem("device mesh", f"distributed.{key}", message, fix)


def mesh_problems(spec: RunSpec) -> list[Problem]:
    """The config's rules for tensor/context/pipeline degrees above 1 (none when all are 1)."""
    d, m = spec.config.distributed, spec.mesh
    given = [k for k in DEGREE_KEYS if getattr(d, k) > 1]
    if not given:
        return []
    degrees = ", ".join(f"{k} {getattr(d, k)}" for k in given)
    out = []
    if spec.strategy != MESH_STRATEGY:
        out.append(
            _p(
                given[0],
                f"{degrees} needs distributed.strategy fsdp (or auto), not {spec.strategy_label}",
                "the mesh's data dimension is FSDP2 sharding; set strategy: fsdp",
            )
        )
    rest = d.tensor_parallel * d.context_parallel * d.pipeline_parallel
    if spec.world_size % rest:
        out.append(
            _p(
                given[0],
                f"{degrees} ({rest} ranks per model replica) does not divide world_size {spec.world_size}",
                f"use a world size that is a multiple of {rest}",
            )
        )
    if d.pipeline_parallel > 1:
        out.extend(_pipeline_problems(spec))
    model, training = spec.config.model, spec.config.training
    unsupported = {
        "model.quantization": model.quantization is not None,
        "model.device_map": model.device_map is not None,
        "model.liger": model.liger,
        "model.factory": model.factory is not None,
        "data.factory": spec.config.data.factory is not None,
        "distributed.offload_params": d.offload_params,
    }
    for key, on in unsupported.items():
        if on:
            out.append(
                Problem("device mesh", key, f"{key} cannot be combined with {degrees}", f"drop {key} or the degrees")
            )
    objectives = {st.training.objective for st in spec.stages} | {training.objective}
    if objectives - {"sft"}:
        out.append(
            Problem(
                "device mesh",
                "training.objective",
                f"training.objective {', '.join(sorted(objectives - {'sft'}))} cannot be combined with {degrees}: "
                "a preference objective's per-sequence log-probabilities are not split over ranks yet",
                "train preference objectives with data parallelism (fsdp, deepspeed, ddp)",
            )
        )
    if m.context > 1:
        for st in spec.stages:
            key = "data.max_seq_length" if st.index == 0 else f"stages.{st.index}.data.max_seq_length"
            if st.data.packing and st.data.max_seq_length > MAX_PACKED_CONTEXT_LENGTH:
                gib = st.data.max_seq_length**2 * 3 / 2**30  # the bool mask and a bf16 bias, per row
                out.append(
                    Problem(
                        "device mesh",
                        key,
                        f"{key} {st.data.max_seq_length} with data.packing under distributed.context_parallel "
                        f"needs a dense [B, 1, T, T] document mask and SDPA's bias from it: {gib:,.0f} GiB per "
                        f"row (packed rows are refused above {MAX_PACKED_CONTEXT_LENGTH:,} tokens)",
                        "set data.packing: false (unpacked rows attend causally, with no mask) or a shorter max_seq_length",
                    )
                )
            if st.data.max_seq_length % m.context:
                out.append(
                    Problem(
                        "device mesh",
                        key,
                        f"{key} {st.data.max_seq_length} is not divisible by distributed.context_parallel {m.context}",
                        f"use a multiple of {m.context}",
                    )
                )
    return out


def _pipeline_problems(spec: RunSpec) -> list[Problem]:
    """Pipeline parallelism's config rules: 1F1B needs at least as many micro-batches per step as
    stages; the stages run the layers directly (no Liger head, no activation offload, no fp16 loss
    scaling across stages), and it is tested with data parallelism only."""
    d, m, model = spec.config.distributed, spec.mesh, spec.config.model
    out = []
    steps = spec.batch.gradient_accumulation_steps
    if steps < d.pipeline_parallel:
        out.append(
            _p(
                "pipeline_parallel",
                f"distributed.pipeline_parallel {d.pipeline_parallel} needs at least {d.pipeline_parallel} micro-batches "
                f"per step on each rank (1F1B), but gradient_accumulation_steps is {steps}",
                "raise training.global_batch_size or lower training.micro_batch_size",
            )
        )
    if m.tensor > 1 or m.context > 1:
        out.append(
            _p(
                "pipeline_parallel",
                "distributed.pipeline_parallel cannot be combined with tensor_parallel or context_parallel yet",
                "use pipeline_parallel with data parallelism only",
            )
        )
    refused = {
        "model.activation_offload": model.activation_offload,
        "model.dtype float16": spec.precision.compute == "float16",
    }
    for key, on in refused.items():
        if on:
            out.append(
                Problem(
                    "device mesh",
                    key.split()[0],
                    f"{key} cannot be combined with distributed.pipeline_parallel",
                    f"drop {key.split()[0]} or use pipeline_parallel: 1",
                )
            )
    return out


def model_mesh_problems(mesh: Mesh, hf_config: Any) -> list[Problem]:
    """The model's rules: tensor parallelism splits heads, key-value heads and the MLP width;
    context parallelism (all-to-all over heads) splits the heads left after it; windowed or
    chunked attention is refused under context parallelism (a slice would attend across a window
    it cannot see); pipeline parallelism splits the layers.

    Args:
        mesh: the decided degrees.
        hf_config: the model's `transformers` config (its text config for multimodal models).
    """
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    width = int(getattr(text, "intermediate_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    out = []
    if mesh.tensor > 1 and head_transforms_logits(text):
        out.append(
            _p(
                "tensor_parallel",
                f"distributed.tensor_parallel cannot train {type(text).__name__}: its head transforms the logits "
                "(soft-capping or a logit scale), which the vocabulary-parallel loss does not apply",
                "use tensor_parallel: 1 for this model",
            )
        )
    if mesh.tensor > 1:
        for what, n in (("attention heads", heads), ("key-value heads", kv), ("MLP width (intermediate_size)", width)):
            if n % mesh.tensor:
                out.append(
                    _p(
                        "tensor_parallel",
                        f"distributed.tensor_parallel {mesh.tensor} does not divide the model's {what} ({n})",
                        "choose a degree that divides heads, key-value heads and intermediate_size",
                    )
                )
    if mesh.context > 1:
        local_heads, local_kv = heads // mesh.tensor, kv // mesh.tensor
        if local_heads % mesh.context or local_kv % mesh.context:
            out.append(
                _p(
                    "context_parallel",
                    f"distributed.context_parallel {mesh.context} does not divide the attention heads ({local_heads}) "
                    f"and key-value heads ({local_kv}) each rank holds after tensor_parallel {mesh.tensor}: the "
                    "all-to-all exchange gives each rank whole heads",
                    "choose a context degree that divides both",
                )
            )
        windowed = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
        kinds = set(getattr(text, "layer_types", None) or ())
        if windowed or kinds - {"full_attention"}:
            out.append(
                _p(
                    "context_parallel",
                    f"distributed.context_parallel cannot train {type(text).__name__}: its sliding-window or "
                    "chunked attention layers would attend across slices held by other ranks",
                    "use context_parallel: 1 for this model",
                )
            )
    if mesh.pipeline > 1:
        out.extend(_pipeline_model_problems(mesh, text, layers))
    return out


def _pipeline_model_problems(mesh: Mesh, text: Any, layers: int) -> list[Problem]:
    """A stage builds one causal mask for all its layers and computes the head itself; a tied head
    would live on two stages (torchtitan does not split tied models either)."""
    out = []
    windowed = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
    if windowed or set(getattr(text, "layer_types", None) or ()) - {"full_attention"}:
        out.append(
            _p(
                "pipeline_parallel",
                f"distributed.pipeline_parallel cannot train {type(text).__name__}: its stages build one causal "
                "mask for all layers, not sliding-window or chunked ones",
                "use pipeline_parallel: 1 for this model",
            )
        )
    if getattr(text, "tie_word_embeddings", False):
        out.append(
            _p(
                "pipeline_parallel",
                f"distributed.pipeline_parallel cannot train {type(text).__name__} with its head tied to the input "
                "embeddings: they would sit on the first and last stage",
                "use pipeline_parallel: 1 for this model",
            )
        )
    if head_transforms_logits(text):
        out.append(
            _p(
                "pipeline_parallel",
                f"distributed.pipeline_parallel cannot train {type(text).__name__}: the last stage computes the "
                "head without the model's logit transform",
                "use pipeline_parallel: 1 for this model",
            )
        )
    if layers % mesh.pipeline:
        out.append(
            _p(
                "pipeline_parallel",
                f"distributed.pipeline_parallel {mesh.pipeline} does not divide the model's {layers} layers",
                "choose a degree that divides num_hidden_layers",
            )
        )
    return out

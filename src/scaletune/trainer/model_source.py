"""Where the model a run trains comes from, as one variation point: a Hugging Face model
(`from_pretrained`, wrapped in `models.loss.CausalLMLoss`, fed text batches) or your own module
(`model.factory`, wrapped in `models.custom.CustomModelLoss`, fed any batch). Each source carries
its loading, its loss module, its tokenizer or processor, its batch kind and the prefix its
parameters have inside the loss module."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from scaletune.trainer.batches import CUSTOM, TEXT, BatchKind

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec
    from scaletune.strategies.protocol import LoopStrategy

__all__ = ["FactorySource", "ModelSource", "PretrainedSource", "model_source"]

log = logging.getLogger(__name__)


class ModelSource(ABC):
    """The model of one run, before the engine wraps it.

    Attributes:
        kind: how the loop reads and counts a micro-batch for this model.
        prefix: the parameters' name prefix inside the loss module (`stages[].trainable` patterns
            are matched without it, the engines see names with it).
        model_first: the model loads before the data (a factory's data factory is handed the
            tokenizer or processor the model factory returns); else the data first, so bad data
            fails before a large model loads.
    """

    kind: ClassVar[BatchKind]
    prefix: ClassVar[str]
    model_first: ClassVar[bool]

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    def tokenizer(self) -> Any:
        """`model.tokenizer` (or the model's own), loaded; None where the source has none."""
        from scaletune.models import load_tokenizer

        return load_tokenizer(self.spec.config.model)

    def processor(self) -> Any:
        """A vision-language model's processor (`models.vision.load_processor`), which renders its
        data; None for a model whose tokenizer does."""
        return None

    @abstractmethod
    def load(self, strategy: LoopStrategy) -> tuple[nn.Module, Any]:
        """(the model in its storage dtype where the strategy wants it, on the meta device on ranks the
        engine fills; the tokenizer or processor the source returned with it, or None).

        Raises:
            UserError: what `models.prepare_model` or `models.factory.build_model` raise.
        """

    @abstractmethod
    def loss(self, model: nn.Module, strategy: LoopStrategy) -> nn.Module:
        """The module the engine wraps: its forward returns the summed loss of a micro-batch."""

    def load_reference(self, strategy: LoopStrategy, name_or_path: str | None = None) -> nn.Module:
        """The frozen reference model of `training.preference.reference: model` (or the distillation
        teacher `name_or_path`), resident as the engine keeps the policy (`strategy.wrap_reference`).
        A collective under fsdp and ZeRO-3.

        Raises:
            UserError: the source has no reference model (a factory's module).
        """
        from scaletune.errors import UserError

        raise UserError(
            f"training.preference.reference: model needs a Hugging Face causal LM (model.name_or_path), "
            f"not model.factory {self.spec.config.model.factory}: use reference precomputed"
        )


class PretrainedSource(ModelSource):
    """A Hugging Face causal LM (`model.name_or_path`), with its tokenizer; text batches."""

    kind = TEXT
    prefix = "causal_lm."
    model_first = False

    def attention(self, strategy: LoopStrategy) -> str | None:
        """The `attn_implementation` the model loads with (`models.attention.packed_attention`).

        Decided for the device the rank computes on (`strategy.device`), not where the weights load
        (`strategy.placement.device`): FSDP and DeepSpeed load on the CPU and move the model to the
        rank's GPU themselves, so the load device made every FSDP / ZeRO run on GPUs keep sdpa and log
        "no flex_attention backward on the CPU" (issue 38).
        """
        from scaletune.models import load_config
        from scaletune.models.attention import packed_attention

        m, packing = self.spec.config.model, self.spec.packs
        return packed_attention(m, load_config(m) if packing else None, packing=packing, device=str(strategy.device))

    def processor(self) -> Any:
        from scaletune.models.loading import model_processor

        return model_processor(self.spec.config.model)

    def load(self, strategy: LoopStrategy) -> tuple[nn.Module, Any]:
        from scaletune.models import prepare_model

        spec = self.spec
        m = spec.config.model
        model_cfg = m.model_copy(
            update={"dtype": spec.precision.storage, "attn_implementation": self.attention(strategy)}
        )
        return prepare_model(model_cfg, strategy.placement, meta=strategy.load_meta()), None

    def load_reference(self, strategy: LoopStrategy, name_or_path: str | None = None) -> nn.Module:
        """`model.name_or_path` again (or the teacher `name_or_path`), without LoRA, quantization,
        gradient checkpointing or compile (it never trains), in the run's storage dtype, where the
        strategy loads the policy (on the meta device on the ranks the engine fills), then handed to
        `strategy.wrap_reference`.

        Raises:
            UserError: what `models.prepare_model` raises.
        """
        from scaletune.models import prepare_model

        spec = self.spec
        m = spec.config.model
        cfg = m.model_copy(
            update={
                "dtype": spec.precision.storage,
                # The policy's attention implementation (`load`), so both compute alike.
                "attn_implementation": self.attention(strategy),
                "lora": None,
                "quantization": None,
                "gradient_checkpointing": False,
                "compile": False,
            }
            | ({"name_or_path": name_or_path} if name_or_path else {})
        )
        model = prepare_model(cfg, strategy.placement, meta=strategy.load_meta(), frozen=True)
        return strategy.wrap_reference(model)

    def loss(self, model: nn.Module, strategy: LoopStrategy) -> nn.Module:
        from scaletune.models.loss import CausalLMLoss

        m = self.spec.config.model
        return CausalLMLoss(
            model, activation_offload=m.activation_offload, liger=m.liger, partitioned_head=strategy.partitions_head
        )


class FactorySource(ModelSource):
    """Your module from `model.factory`, with the tokenizer or processor it returns (else
    `model.tokenizer`, else none); any batch its data factory's collator makes."""

    kind = CUSTOM
    prefix = "model."
    model_first = True

    def tokenizer(self) -> Any:
        return super().tokenizer() if self.spec.config.model.tokenizer else None

    def load(self, strategy: LoopStrategy) -> tuple[nn.Module, Any]:
        from scaletune.models.factory import build_model, checkpoint_blocks, shard_classes

        spec = self.spec
        m = spec.config.model
        meta = strategy.load_meta()
        model, processor = build_model(m, meta=meta, dtype=spec.precision.storage, device=strategy.placement.device)
        blocks = shard_classes(model, m.shard_modules)
        if m.gradient_checkpointing:
            n = checkpoint_blocks(model, blocks)
            log.info(f"gradient checkpointing: {n} blocks of the factory's module (non-reentrant)")
        if m.compile:
            for block in [b for b in model.modules() if isinstance(b, blocks)]:
                block.compile()
        total = sum(p.numel() for p in model.parameters())
        log.info(
            f"model.factory {m.factory}: {type(model).__name__}, {total:,} parameters{' (meta device)' if meta else ''}"
        )
        return model, processor

    def loss(self, model: nn.Module, strategy: LoopStrategy) -> nn.Module:
        from scaletune.models.custom import CustomModelLoss
        from scaletune.models.factory import shard_classes

        m = self.spec.config.model
        return CustomModelLoss(model, m, shard_classes(model, m.shard_modules), activation_offload=m.activation_offload)


def model_source(spec: RunSpec) -> ModelSource:
    """The run's source: `model.factory` when set, else `from_pretrained`."""
    return FactorySource(spec) if spec.config.model.factory is not None else PretrainedSource(spec)

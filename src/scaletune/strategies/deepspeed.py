"""DeepSpeed ZeRO stages 1-3 (Rajbhandari et al. 2020, arXiv:1910.02054), with optimizer and
parameter offload (ZeRO-Offload, Ren et al. 2021), through `deepspeed.initialize`.

ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters. The
DeepSpeed config comes from :func:`scaletune.strategies.deepspeed_config.engine_config` (the one
generator, shared with `scaletune config deepspeed`); a user's own JSON
(`distributed.deepspeed_config`) is merged under it and checked for agreement. The model stays on
the CPU until DeepSpeed places it. On a CPU-only machine run with `DS_ACCELERATOR=cpu` (gloo).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletune.strategies.base import Strategy
from scaletune.strategies.deepspeed_config import engine_config, steps_with_cpu_adam
from scaletune.strategies.optim import apply_trainable


def unshare_step_counters(optimizer: torch.optim.Optimizer) -> int:
    """Give every optimizer state its own `step` tensor; returns how many were shared.

    DeepSpeed 0.19.8's ZeRO-3 universal loader (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`)
    assigns one `step` tensor to the state of every sub-group. torch's Adam/AdamW increment
    `state["step"]` in place, so with two parameter groups (decay / no decay) the shared counter
    advanced twice per optimizer step and Adam's bias correction drifted (3e-4 in the loss after three
    steps). Cloning restores one counter per group, as a native checkpoint load has."""
    seen: set[int] = set()
    shared = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if not torch.is_tensor(step):
            continue
        if id(step) in seen:
            state["step"] = step.clone()
            shared += 1
        seen.add(id(step))
    return shared


def skip_shared_memory_all_reduce() -> None:
    """Keep DeepSpeed's communication layer from building its shared-memory all-reduce on the CPU
    accelerator. Its torch backend compiles that C++ extension when it starts, whatever runs (about
    2 CPU-minutes and a compiler on the machine, the first time; then shared-memory segments between
    the ranks), but only `inference_all_reduce` uses it (deepspeed/comm/torch.py, `build_shm_op`,
    DeepSpeed 0.19): training reduces through torch.distributed (gloo). An op marked incompatible is
    one `build_shm_op` leaves unbuilt, as on a machine where it cannot build."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    engine_places_model = True
    needs_process_group = True
    checkpoint_format = "deepspeed"

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.ds_config = engine_config(spec)
        self.engine: Any = None
        self._hf_ds_config: Any = None
        self._skipped_steps = 0
        self._reference_engine: Any = None

    @property
    def partitions_head(self) -> bool:  # type: ignore[override]
        return self.spec.zero_stage == 3

    def setup(self) -> None:
        if not self.env.cuda_available:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().setup()  # DeepSpeed uses this group (one of one at world size 1)
        import deepspeed
        import torch.distributed as dist

        if not self.env.cuda_available:
            skip_shared_memory_all_reduce()

        # DeepSpeed's communication layer adopts that group now, not at `initialize`: ZeRO-3's
        # zero.Init during loading reads the world size from it (else 1, and its batch check fails).
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        # A factory's module is built as its factory builds it (and ZeRO-3 partitions it at
        # `initialize`): a zero.Init around the factory would change its random initialisation.
        if self.spec.zero_stage == 3 and not self.spec.custom_model:
            self._announce_zero3()

    def _announce_zero3(self) -> None:
        """Make `from_pretrained` build the model partitioned, so no rank ever holds all of it.

        transformers builds the model under `deepspeed.zero.Init` (each parameter partitioned over the
        ranks as it is created, on the device ZeRO will keep it) and loads the checkpoint one module
        at a time, gathered, copied on rank 0, re-partitioned, while an `HfDeepSpeedConfig` with ZeRO-3
        is alive: transformers holds only a weak reference to it, so this strategy keeps it until
        `teardown` (withdrawn only inside :meth:`loading_alone`). Without it every rank would load a
        full fp32 copy on the host and DeepSpeed would move the whole module to the GPU before
        partitioning it: exactly the models ZeRO-3 is chosen for (larger than one GPU) would not
        load. Quantized models are loaded whole, as transformers
        does for them (bitsandbytes quantizes on the device)."""
        from transformers.integrations import HfDeepSpeedConfig

        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)

    @contextlib.contextmanager
    def loading_alone(self) -> Iterator[None]:
        """ZeRO-3: the `HfDeepSpeedConfig` withdrawn from transformers meanwhile. While it is announced,
        transformers builds every model under `zero.Init` and loads it through `GatheredParameters`
        (collectives), and `generate` defaults to `synced_gpus` (an all-reduce per token): a model
        rank 0 loads alone for the sample prompts would wait for ranks that never join."""
        if self._hf_ds_config is None:
            yield
            return
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            set_hf_deepspeed_config(self._hf_ds_config)

    def teardown(self) -> None:
        if self._hf_ds_config is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self._hf_ds_config = None
        super().teardown()

    def destroy_process_group(self) -> None:
        # DeepSpeed keeps its data-parallel (and other) groups in module globals
        # (deepspeed/utils/groups.py); destroying through deepspeed.comm releases them, where
        # torch's own call leaves them pointing at the destroyed group, and the next engine of the
        # process fails in its first broadcast ("Group ... is not registered").
        from deepspeed.comm import comm

        if comm.cdb is None:  # the run ended before DeepSpeed's communication was set up
            super().destroy_process_group()
        else:
            comm.destroy_process_group()

    def make_scaler(self) -> Any:
        return None  # DeepSpeed's fp16 mode scales the loss itself (dynamic, `fp16.loss_scale: 0`)

    def wrap(self, model: nn.Module) -> None:
        self._keep_blocks_whole(model)
        self._initialize(model)
        self.log.info(
            f"deepspeed: ZeRO-{self.spec.zero_stage}"
            f"{self._offload_label()}"
            f"{', parameter offload' if self.spec.offload_params else ''}"
        )

    def _offload_label(self) -> str:
        if not self.spec.offload_optimizer:
            return ""
        return ", optimizer offload" + ("" if steps_with_cpu_adam(self.spec) else " (no GPU: stepped by torch's AdamW)")

    def _initialize(self, model: nn.Module) -> None:
        import deepspeed

        optimizer = self._optimizer(model)
        self.engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        self.module = model
        self.model = self.engine
        # The loop's schedule drives the client optimizer: ZeRO's wrapper shares its param_groups (and
        # so the learning rate) but is not a torch Optimizer that LambdaLR accepts.
        self.optimizer = getattr(ds_optimizer, "optimizer", ds_optimizer)
        self._finish_wrap()

    def wrap_reference(self, model: nn.Module) -> nn.Module:
        """ZeRO-3: the frozen reference partitioned by its own `deepspeed.initialize`, without an
        optimizer (TRL's `prepare_deepspeed`), the engine's module returned (the engine kept for its
        hooks); ZeRO-1/2: whole on the device, parameters in the compute dtype as DeepSpeed casts the
        policy's (`strategies/frozen_reference.py`)."""
        from scaletune.strategies import frozen_reference as ref

        if self.spec.zero_stage != 3:
            dtype = None if self.compute_dtype == torch.float32 else self.compute_dtype
            self.reference = ref.resident_whole(model, self.device, dtype)
            return self.reference
        import deepspeed

        frozen = ref.freeze(model)
        self._reference_engine, *_ = deepspeed.initialize(model=frozen, config=ref.reference_ds_config(self.ds_config))
        self._reference_engine.eval()
        self.reference = self._reference_engine.module
        return self.reference

    def _keep_blocks_whole(self, model: nn.Module) -> None:
        """ZeRO-3: a factory's blocks (`models.factory.shard_classes`, named in the loss module's
        `_no_split_modules`) become leaf modules, whose parameters are gathered together when the
        block's forward starts, so code inside a block may read any of them directly."""
        names = getattr(model, "_no_split_modules", None)
        if self.spec.zero_stage == 3 and names:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, list({type(m) for m in model.modules() if type(m).__name__ in names}))

    def retarget(self, trainable: frozenset[str]) -> None:
        # ZeRO's optimizer flattens and partitions the parameters it was built with, and hooks their
        # gradients: a new trainable set needs a new engine. destroy() removes the old one's
        # parameter hooks; under ZeRO-3 the module stays partitioned and the new engine takes the
        # partitions over.
        self._forget_engine_hooks()
        self.engine.destroy()
        self.engine = None
        self._grad_bytes = None
        apply_trainable(self.module, trainable)
        self._initialize(self.module)

    def _forget_engine_hooks(self) -> None:
        """What DeepSpeed 0.19.8's `destroy()` leaves on the module for the next engine to trip on:
        the engine's forward pre/post hooks on the root, and, under ZeRO-3, each module's
        ``pre_bwd_fn`` / ``post_bwd_fn`` autograd functions. `DeepSpeedZeRoOffload._register_deepspeed_module`
        keeps those when it finds them (``if "pre_bwd_fn" not in module.__dict__``), so the new engine's
        backward would report to the old engine's parameter coordinator: the new one never sees a
        module in backward, and a frozen parameter gathered when a checkpoint recomputes (the head
        under ZeRO-3, `models.loss.chunked_head_cross_entropy`) is released before backward reads it
        (`CheckpointError: ... shape [0]` at the first step after a stage that freezes the head)."""
        for name in ("module_forward_pre_hook", "module_forward_post_hook"):
            handle = getattr(self.engine, name, None)
            if handle is not None:
                handle.remove()
        for module in self.module.modules():
            for attr in ("pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt"):
                module.__dict__.pop(attr, None)

    def move_batch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        # DeepSpeed casts the module, not its inputs, to bf16/fp16: floating inputs (images,
        # features) must match it. Token ids are integers and pass unchanged.
        out = super().move_batch(inputs)
        if self.compute_dtype == torch.float32:
            return out
        return {
            k: v.to(self.compute_dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in out.items()
        }

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        if not steps_with_cpu_adam(self.spec):
            return self.build_optimizer(model)  # ZeRO steps it on its flat fp32 partitions
        # ZeRO-Offload steps the optimizer on the CPU; DeepSpeed's vectorised CPU Adam is the
        # optimizer it is built for (adamw_mode=True: decoupled weight decay as torch's AdamW).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        from scaletune.strategies.optim import param_groups

        t = self.training
        return DeepSpeedCPUAdam(
            param_groups(model, t.weight_decay),
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon,
            adamw_mode=True,
        )

    @property
    def device(self) -> torch.device:
        return self.engine.device if self.engine is not None else self.env.device

    @property
    def grad_divisor(self) -> float:
        return float(self.env.world_size)  # ZeRO averages gradients over data-parallel ranks

    def backward(self, loss: torch.Tensor) -> None:
        # scale_wrt_gas=False: the loss is already normalised over the whole global batch.
        self.engine.backward(loss * self.grad_divisor, scale_wrt_gas=False)
        # DeepSpeed counts micro-steps in step(); it updates only at the accumulation boundary.
        self.engine.step()

    def step(self) -> torch.Tensor:
        # fp16: DeepSpeed's loss scaler skips an overflowing step itself and counts it.
        skipped = int(getattr(self.engine, "skipped_steps", 0))
        self.skipped_step = skipped > self._skipped_steps
        self._skipped_steps = skipped
        norm = self.engine.get_global_grad_norm()
        if norm is None:  # zero_optimization.compute_grad_norm false in a user's JSON
            raise RuntimeError("DeepSpeed computed no gradient norm; remove zero_optimization.compute_grad_norm: false")
        # Kept where DeepSpeed computed it (a GPU tensor): float() here would wait for the GPU every
        # step; the loop reads it when it logs. Cloned: DeepSpeed reuses its buffer the next step.
        return norm.detach().clone() if torch.is_tensor(norm) else torch.as_tensor(float(norm))

    def train_mode(self, on: bool) -> None:
        self.engine.train(on)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.spec.zero_stage == 3:
            # A collective: gathers every partition into one state dict on rank 0.
            state = self.engine._zero3_consolidated_16bit_state_dict()
            return state if self.env.is_main else None
        return self.module.state_dict() if self.env.is_main else None

    # -- memory: ZeRO-3 keeps each parameter's partition in `ds_tensor`, the gradient partitions in
    # one flat buffer; ZeRO-1/2's fp32 masters are the optimizer's own parameters.
    def _param_tensors(self) -> list[Any]:
        params = list(self.module.parameters())
        return params + [getattr(p, "ds_tensor", None) for p in params]

    def _grad_tensors(self) -> list[Any]:
        zero = getattr(self.engine, "optimizer", None)
        return super()._grad_tensors() + [getattr(zero, "grad_partitions_flat_buffer", None)]

    # -- checkpoint state: DeepSpeed's own format (each rank writes its ZeRO partition) ------
    _resume_tag = "state"

    def prepare_resume(self, path: Path, world_size: int) -> None:
        """ZeRO partitions are per data-parallel rank; at another world size convert the checkpoint
        once to DeepSpeed's universal format (per-parameter fp32 weights and optimizer moments,
        `deepspeed.checkpoint.ds_to_universal`) and load that, which DeepSpeed re-partitions."""
        if world_size == self.env.world_size:
            return
        universal = path / "deepspeed" / "universal"
        if self.env.is_main and not universal.is_dir():
            import argparse

            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            tmp = path / "deepspeed" / ".universal.tmp"
            ds_to_universal(
                argparse.Namespace(
                    input_folder=str(path / "deepspeed" / "state"),
                    output_folder=str(tmp),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=True,  # plain (non-Megatron) models carry no universal_checkpoint_info
                )
            )
            os.replace(tmp, universal)
        self.barrier()
        self.ds_config.setdefault("checkpoint", {})["load_universal"] = True
        self._resume_tag = "universal"

    def save_state(self, path: Path) -> None:
        # Frozen weights that trained in an earlier stage must be saved (all frozen ones then are).
        self.engine.save_checkpoint(
            str(path / "deepspeed"),
            tag="state",
            save_latest=False,
            exclude_frozen_parameters=not self.checkpointed_frozen,
        )

    def load_state(self, path: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(
            str(path / "deepspeed"),
            tag=self._resume_tag,
            load_module_strict=False,  # a LoRA checkpoint holds only the adapter
            load_optimizer_states=True,
            load_lr_scheduler_states=False,  # scaletune saves its scheduler itself
        )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {path / 'deepspeed'}")
        if self._resume_tag == "universal":
            self._load_frozen_weights(path)
            if unshare_step_counters(self.optimizer):
                self.log.info("deepspeed: gave each parameter group its own Adam step counter after the universal load")

    def _load_frozen_weights(self, path: Path) -> None:
        """At another world size DeepSpeed's universal load restores only the parameters its
        optimizer holds (from the universal `zero/` folder; `DeepSpeedEngine._load_checkpoint` skips
        the module state), so weights an earlier stage trained and this stage freezes would keep the
        values the model was loaded with. They come from the checkpoint itself (`save_state` keeps
        them): ZeRO-1/2 from its module state, whole on every rank; ZeRO-3 from the frozen fragments
        of every old rank's file, merged by DeepSpeed's `zero_to_fp32` on rank 0 and scattered to the
        new partitions (`GatheredParameters(modifier_rank=0)`). Every `torch.load` here is the
        restricted one (`safe_load.enforce`)."""
        if not self.checkpointed_frozen:
            return
        names = sorted(self.checkpointed_frozen)
        params = dict(self.module.named_parameters(remove_duplicate=False))  # a tied tensor under each name
        saved: dict[str, torch.Tensor] = {}
        if self.spec.zero_stage != 3:
            from scaletune.safe_load import restricted_load

            files = sorted((path / "deepspeed" / "state").glob("mp_rank_*_model_states.pt"))
            assert files, f"no module state under {path / 'deepspeed' / 'state'}"
            saved = restricted_load(files[0])["module"]
        elif self.env.is_main:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            saved = get_fp32_state_dict_from_zero_checkpoint(str(path / "deepspeed"), tag="state")
        missing = [n for n in names if n not in params or (saved and n not in saved)]
        if missing:
            from scaletune.errors import UserError

            raise UserError(
                f"{path} lacks weights an earlier stage trained and its stage freezes: {', '.join(missing[:4])}",
                title="cannot resume",
            )
        gathered = contextlib.nullcontext()
        if self.spec.zero_stage == 3:
            import deepspeed

            unique = list({id(params[n]): params[n] for n in names}.values())
            gathered = deepspeed.zero.GatheredParameters(unique, modifier_rank=0)
        with gathered, torch.no_grad():
            for name in names if saved else ():
                params[name].copy_(saved[name].to(params[name].device, params[name].dtype))
        self.log.info(f"deepspeed: restored {len(names)} frozen weights an earlier stage trained from {path.name}")

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                out[f"model.{name}"] = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 partitions report ds_shape
        return out

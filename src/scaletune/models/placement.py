"""Device placement: the one place where `model.device_map` is interpreted.

Nothing in :mod:`scaletune.models` knows about parallelism beyond :func:`resolve_device_map`,
which decides where the weights go given how the process was launched (DESIGN.md: model code
never mentions parallelism; the strategies wrap what this package returns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletune.config.schema import check_device_map
from scaletune.env import DistributedEnv
from scaletune.errors import UserError


@dataclass(frozen=True)
class DevicePlacement:
    """Where the model's weights go.

    Attributes:
        device_map: passed to `from_pretrained` (`"auto"`, `"sequential"`, `{"": "cuda:0"}`...),
            or None: load, then `.to(device)`.
        device: where the model (or, with a device_map, its inputs) lives: `"cpu"`, `"cuda:1"`.
        message: what was decided and why, when it differs from what was asked; :func:`load_model`
            logs it, callers need not.
    """

    device_map: str | dict[str, Any] | None
    device: str
    message: str | None = None


def resolve_device_map(
    requested: str | None, env: DistributedEnv, *, engine_places_model: bool = False
) -> DevicePlacement:
    """Decide where the model goes: THE one interpretation of `model.device_map`.

    Single process (`env.launched` is False): `auto` / `sequential` / `balanced` /
    `balanced_low_0` are passed to `from_pretrained` (accelerate splits the layers over the
    visible GPUs: naive pipeline parallelism, one GPU busy at a time; useful to fit a model that
    no single GPU holds), or resolve to the CPU with a message where no GPU is visible; `cuda:N`
    loads onto that GPU; `cpu` stays on the CPU; None means the process's device.

    Under any launcher (torchrun, the deepspeed launcher, srun, or RANK / LOCAL_RANK /
    WORLD_SIZE set by hand, even at world size 1) a requested device_map is set aside: DDP,
    FSDP and ZeRO give every rank its own replica or shard on its own GPU, while
    `device_map="auto"` would have each rank spread a whole model over every visible GPU,
    so that 8 ranks stack 8 copies on the same GPUs and the engines see parameters on devices
    they do not own. The model goes on the rank's device (`cuda:<local_rank>` or `cpu`), or
    stays on the CPU when `engine_places_model` (DeepSpeed moves it itself in `initialize`).

    Args:
        requested: `model.device_map` (None, `auto`, `sequential`, `balanced`,
            `balanced_low_0`, `cpu`, `cuda:N`).
        env: how the process was launched and which GPUs it sees.
        engine_places_model: the strategy moves the model itself (DeepSpeed).

    Returns:
        The :class:`DevicePlacement`.

    Raises:
        RuntimeError: `cuda:N` asked in a single process where no CUDA device (or no device N)
            is visible.
        UserError: `requested` is not one of the values above.
    """
    try:  # the schema's check again: hf.py's callers pass a device_map without a config
        check_device_map(requested)
    except ValueError as exc:
        raise UserError(f"model.device_map {requested!r}: {exc}", title="invalid config") from None
    rank_device = "cpu" if engine_places_model else str(env.device)

    if env.launched:
        if requested is None or requested == rank_device:
            return DevicePlacement(None, rank_device)
        where = (
            "on the CPU for the DeepSpeed engine to place"
            if engine_places_model
            else f"on this rank's device {rank_device}"
        )
        return DevicePlacement(
            None,
            rank_device,
            f"model.device_map={requested} set aside: this process was started by a distributed launcher "
            f"({env.launcher}, rank {env.rank} of {env.world_size}). device_map places one model across the "
            "visible devices within a single process (naive pipeline parallelism), which collides with "
            "DDP / FSDP / DeepSpeed ZeRO, where each rank holds its own replica or shard on its own GPU. "
            f"The model is loaded {where} instead. To split one model over several GPUs in one "
            "process, run without a launcher; to use every GPU for training, keep the launcher and "
            "drop device_map.",
        )

    # A single process from here on.
    if requested is None:
        return DevicePlacement(None, str(env.device))
    if requested == "cpu":
        return DevicePlacement(None, "cpu")
    if requested.startswith("cuda:"):
        index = int(requested[5:])
        if not env.cuda_available:
            raise RuntimeError(
                f"model.device_map={requested}, but there is no CUDA device: torch sees no GPU here "
                "(check CUDA_VISIBLE_DEVICES and the driver with `nvidia-smi`, or `scaletune doctor`). "
                "Set model.device_map to null or cpu to run on the CPU."
            )
        if index >= env.cuda_device_count:
            raise RuntimeError(
                f"model.device_map={requested}, but only {env.cuda_device_count} CUDA device(s) are "
                f"visible (cuda:0..cuda:{env.cuda_device_count - 1}); check CUDA_VISIBLE_DEVICES."
            )
        return DevicePlacement({"": requested}, requested)
    # auto / sequential / balanced / balanced_low_0
    if not env.cuda_available:
        return DevicePlacement(
            None,
            "cpu",
            f"model.device_map={requested}: no CUDA device is visible, so the model is loaded on the CPU.",
        )
    message = None
    if env.cuda_device_count > 1:
        message = (
            f"model.device_map={requested}: the model's layers are split over {env.cuda_device_count} GPUs in "
            "this one process (naive pipeline parallelism: one GPU computes at a time). To train with every "
            "GPU busy, drop device_map and set distributed.num_processes (DDP / FSDP / DeepSpeed)."
        )
    return DevicePlacement(requested, "cuda:0", message)

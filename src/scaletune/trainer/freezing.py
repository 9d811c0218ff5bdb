"""Per-stage freezing: `stages[].trainable` / `frozen` glob patterns turned into the set of
parameters that train in each stage, checked against the model's parameter names, and applied.

Patterns are `fnmatch` globs over the names `model.named_parameters()` gives (your module's own
names; peft's under LoRA): `*` also crosses dots, so `projector.*` is every parameter of
`projector`. A vision-language model's groups are named too: `vision`, `projector`, `language`
(`models.vision.parameter_groups`). A stage without patterns trains what trains by default (everything; the adapters
under LoRA). A tensor shared under several names (tied embeddings) is one parameter: a `trainable`
pattern that names it under any name trains it, a `frozen` pattern that names it under any name
freezes it (so `frozen: [model.embed_tokens.*]` freezes a tied head too; the tied name used to keep
it training, silently).
The engines re-target the optimizer when the set changes (`Strategy.retarget`, which applies the
set with `strategies.optim.apply_trainable`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase

from torch import nn

from scaletune.errors import UserError
from scaletune.models.vision import parameter_groups
from scaletune.resolve import Stage
from scaletune.strategies.optim import apply_trainable

__all__ = ["apply_trainable", "checkpointed_frozen", "peak_stage", "stage_trainable", "trainable_sets"]


def _matching(names: Sequence[str], pattern: str) -> set[str]:
    return {n for n in names if fnmatchcase(n, pattern)}


def stage_trainable(
    names: Sequence[str],
    default: set[str],
    stage: Stage,
    key: str,
    aliases: Mapping[str, frozenset[str]] | None = None,
    groups: Mapping[str, Sequence[str]] | None = None,
) -> tuple[set[str], list[str]]:
    """The names that train in `stage`, and the problems of its patterns.

    Args:
        names: every parameter name of the model (shared tensors under each of their names).
        default: the names that train without patterns.
        key: the config key of the stage (`stages.1`), for messages.
        aliases: for a name of a shared tensor, all of its names (absent: a tensor of one name).
        groups: named groups (`vision`, `projector`, `language` of a vision-language model:
            `models.vision.parameter_groups`), each a list of patterns. A pattern that is a group's
            name means the group's parameters that train by default where it has any (its LoRA
            adapters under LoRA), else all of them.
    """

    def every_name(hit: set[str]) -> set[str]:
        return set().union(*(aliases.get(n, {n}) for n in hit)) if aliases else set(hit)

    def matching(pattern: str) -> set[str]:
        if not groups or pattern not in groups:
            return _matching(names, pattern)
        hit = set().union(*(_matching(names, p) for p in groups[pattern]))
        return (hit & default) or hit

    problems: list[str] = []
    chosen = set(default)
    if stage.trainable is not None:
        chosen = set()
        for pattern in stage.trainable:
            hit = matching(pattern)
            if not hit:
                problems.append(f"{key}.trainable: {pattern!r} matches no parameter")
            chosen |= every_name(hit)
    for pattern in stage.frozen or ():
        hit = matching(pattern)
        if not hit:
            problems.append(f"{key}.frozen: {pattern!r} matches no parameter")
        chosen -= every_name(hit)
    if not chosen and not problems:
        problems.append(f"{key} ({stage.name}): trainable / frozen leave no parameter to train")
    return chosen, problems


def trainable_sets(model: nn.Module, stages: Sequence[Stage], *, prefix: str = "", numbered: bool = True) -> list:
    """Per stage, the full names (`prefix` + the model's name) of the parameters that train; an empty
    list when no stage gives `trainable` or `frozen` (nothing changes between stages then).

    Works on the meta device (names only). Call it before the model is wrapped, with the
    parameters' `requires_grad` as loaded (the default set).

    Args:
        prefix: the loss module's prefix (`causal_lm.`, `model.`): names as the engines see them.
        numbered: stages come from `stages:` (keys `stages.N`), else the implicit stage.

    Raises:
        UserError: a pattern that matches no parameter; a stage left with nothing to train. All at once.
    """
    if not any(s.trainable is not None or s.frozen is not None for s in stages):
        return []
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    default = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    by_tensor: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), set()).add(n)
    aliases = {n: frozenset(group) for group in by_tensor.values() if len(group) > 1 for n in group}
    groups = parameter_groups(model)
    out, problems = [], []
    for stage in stages:
        key = f"stages.{stage.index}" if numbered else "stage"
        chosen, found = stage_trainable(names, default, stage, key, aliases, groups)
        problems += found
        out.append(frozenset(prefix + n for n in chosen))
    if problems:
        sample = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise UserError([*problems, f"(the model's parameters are named like: {sample})"], title="invalid stages")
    return out


def checkpointed_frozen(sets: Sequence[frozenset[str]], index: int) -> frozenset[str]:
    """Frozen in stage `index` but trained in an earlier stage: a checkpoint of that stage must hold
    these weights too, or a resume would return them to their initial values."""
    ever = frozenset().union(*sets[: index + 1])
    return ever - sets[index]


def peak_stage(sets: Sequence[frozenset[str]], model: nn.Module, *, prefix: str = "") -> int | None:
    """The stage that trains the most parameter elements (its optimizer state and gradients are
    the run's largest; the first of equals), or None without per-stage sets. Works on the meta
    device; every rank computes the same (the memory report runs in that stage on all ranks)."""
    if not sets:
        return None
    sizes = {prefix + n: p.numel() for n, p in model.named_parameters()}
    totals = [sum(sizes.get(n, 0) for n in s) for s in sets]
    return totals.index(max(totals))

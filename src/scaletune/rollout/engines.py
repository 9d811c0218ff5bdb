"""Generation engines behind one interface: `generate(prompt_ids, prompt_mask, n, ...)` returns the
completions' token ids; `update_weights` hands an engine the policy after an optimizer step.

- `HFEngine`: the trained module's own `generate` (transformers), so there are no weights to copy
  and the engine's log-probs are the trainer's own.
- `ReplayEngine`: completions read back from a rollouts.jsonl (`training.rl.replay`), looked up by
  (split, step, prompt index): offline RL, and the exact reproduction of a run on another world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from scaletune.config.distill import DistillConfig
from scaletune.config.rl import RLConfig
from scaletune.errors import UserError

__all__ = ["Engine", "HFEngine", "ReplayEngine", "completion_mask", "make_engine"]


def completion_mask(completions: torch.Tensor, eos_ids: set[int], lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[R, C] 1 on each completion's tokens up to and including its first end-of-sequence token
    (TRL's completion_mask), 0 after it; `lengths` [R], when given, also ends row r at lengths[r]."""
    is_eos = torch.zeros_like(completions, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completions == e
    size = completions.size(1)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(completions[:, 0], size))
    positions = torch.arange(size, device=completions.device).expand_as(completions)
    mask = positions <= first.unsqueeze(1)
    if lengths is not None:
        mask &= positions < lengths.to(completions.device).unsqueeze(1)
    return mask.long()


class Engine:
    """Samples `n` completions of each prompt.

    `generate(prompt_ids [m, P] left-padded, prompt_mask [m, P], n, split, step, prompt_index [m])`
    returns (completions [m * n, C] int64, the n of prompt i in rows i*n .. i*n+n-1, padded after
    their end; lengths [m * n] int64: tokens of each, its end-of-sequence token included).
    """

    name = "engine"

    def generate(self, prompt_ids, prompt_mask, n, *, split: str, step: int, prompt_index) -> tuple[Any, Any]:
        raise NotImplementedError

    def update_weights(self) -> None:
        """After an optimizer step: nothing for engines that read the trained module itself."""


class HFEngine(Engine):
    """`generate` of the trained model (`strategy.module.generate`, the causal LM's: the module DDP
    and DeepSpeed ZeRO-1/2 hold whole, whose parameters ZeRO-3's hooks gather for each submodule's
    forward and FSDP2's for each layer's, its root unit gathered around the whole call),
    in eval mode (no dropout), sampling at `temperature` and `top_p` from the whole vocabulary
    (`top_k` 0, no repetition penalty: the model's generation_config is not read).

    Where the engine shards the parameters (ZeRO-3, fsdp) on several ranks, every forward is a collective,
    so generation runs `synced_gpus`: a rank whose completions have all ended goes on with forwards
    (whose tokens it discards) until every rank's have, as transformers' `generate` does when it sees
    ZeRO-3 announced; it is passed, not left to that detection, since a rank that left the loop
    first would leave the others waiting in an all-gather.

    Each call samples from its own seed, drawn from (the run's seed, this rank, split, step, the
    call's place in that step), in a forked RNG: ranks sample independently (on the run's one
    seed they drew the same random numbers, so a prompt-insensitive model gave every rank the same
    completions; TRL seeds each process apart for the same reason, `set_seed(seed,
    device_specific=True)` in GRPOTrainer), a resumed run draws what the uninterrupted one drew
    without restoring any RNG, and sampling leaves the training RNG (dropout) untouched."""

    name = "hf"

    def __init__(self, strategy: Any, tokenizer: Any, settings: RLConfig | DistillConfig) -> None:
        self.strategy, self.tokenizer, self.settings = strategy, tokenizer, settings
        self.eos = eos_ids(tokenizer)
        self.synced = strategy.spec.shards_params and strategy.env.world_size > 1
        self.last_call: tuple[str, int, int] = ("", -1, -1)  # (split, step, call) of the last `generate`

    def sampling_seed(self, split: str, step: int) -> int:
        """The seed of this rank's next `generate` call at (split, step): 63 bits of
        sha256(run seed / rank / split / step / call)."""
        import hashlib

        last_split, last_step, last = self.last_call
        call = last + 1 if (last_split, last_step) == (split, step) else 0
        self.last_call = (split, step, call)
        key = f"{self.strategy.spec.config.seed}/{self.strategy.env.rank}/{split}/{step}/{call}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1

    def generate(self, prompt_ids, prompt_mask, n, *, split, step, prompt_index):
        from transformers import GenerationConfig

        s, strategy = self.settings, self.strategy
        model = strategy.module.causal_lm
        device = strategy.device
        config = GenerationConfig(
            do_sample=True,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=0,
            max_new_tokens=s.max_new_tokens,
            num_return_sequences=n,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=sorted(self.eos),
        )
        was_training = model.training
        strategy.train_mode(False)
        seed = self.sampling_seed(split, step)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                out = strategy.module.generate(
                    input_ids=prompt_ids.to(device),
                    attention_mask=prompt_mask.to(device),
                    generation_config=config,
                    synced_gpus=self.synced,
                )
        finally:
            strategy.train_mode(was_training)
        completions = out[:, prompt_ids.size(1) :].cpu()
        if completions.size(1) == 0:
            completions = torch.full((completions.size(0), 1), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = completion_mask(completions, self.eos)
        return completions, mask.sum(1)


class ReplayEngine(Engine):
    """Completions read from a rollouts.jsonl: for (split, step, prompt index) the file's lines of
    that key, in file order (the order they were generated). `key` names the setting that gave the
    file in messages (`training.rl.replay`, `training.distill.replay`)."""

    name = "replay"

    def __init__(self, path: str | Path, pad_token_id: int, key: str = "training.rl.replay") -> None:
        self.path, self.pad, self.key = Path(path).expanduser(), pad_token_id, key
        self.table: dict[tuple[str, int, int], list[list[int]]] = {}
        try:
            lines = self.path.read_text().splitlines()
        except OSError as exc:
            raise UserError(f"{self.key} {self.path}: cannot be read ({exc.strerror})", title="invalid data") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                key = (str(r.get("split", "train")), int(r["step"]), int(r["prompt_index"]))
                ids = [int(t) for t in r["completion_ids"]]
            except (ValueError, KeyError, TypeError):
                raise UserError(
                    f"{self.key} {self.path}, line {number}: not a rollout (a JSON object with step, "
                    "prompt_index and completion_ids)",
                    title="invalid data",
                ) from None
            self.table.setdefault(key, []).append(ids)

    def generate(self, prompt_ids, prompt_mask, n, *, split, step, prompt_index):
        rows: list[list[int]] = []
        for i in prompt_index.tolist():
            got = self.table.get((split, step, i), [])
            if len(got) < n:
                raise UserError(
                    f"{self.key} {self.path}: {len(got)} completions of prompt {i} at {split} step {step}, "
                    f"need num_generations ({n}); replay with the data, seed and batch sizes of the run that wrote it",
                    title="cannot replay",
                )
            rows += got[:n]
        width = max(1, max(len(r) for r in rows))
        out = torch.full((len(rows), width), self.pad, dtype=torch.long)
        for j, r in enumerate(rows):
            out[j, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        return out, torch.tensor([len(r) for r in rows], dtype=torch.long)


def eos_ids(tokenizer: Any) -> set[int]:
    """The tokens that end a completion: the tokenizer's eos (and the chat template's end-of-turn,
    where the tokenizer names one as eos)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    assert ids, "a tokenizer without an eos token cannot end a completion (resolve checks the tokenizer)"
    return ids


def make_engine(settings: Any, strategy: Any, tokenizer: Any, key: str = "training.rl") -> Engine:
    """The engine `settings.engine` names (`settings`: `training.rl`, or on-policy
    `training.distill`, at the config key `key`)."""
    if settings.engine == "replay":
        assert settings.replay is not None
        return ReplayEngine(settings.replay, tokenizer.pad_token_id, key=f"{key}.replay")
    return HFEngine(strategy, tokenizer, settings)

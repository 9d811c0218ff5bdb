"""Generation engines behind one interface: `generate(prompt_ids, prompt_mask, n, ...)` returns the
completions' token ids with the log-probabilities the engine sampled them at (`Generated`);
`update_weights` hands an engine the policy after an optimizer step.

- `HFEngine`: the trained module's own `generate` (transformers), so there are no weights to copy;
  its log-probs are read from the logits it sampled from, so the trainer's must agree with them
  (`training.rl.max_logp_mismatch`).
- `ReplayEngine`: completions read back from a rollouts.jsonl (`training.rl.replay`), looked up by
  (split, step, prompt index), with the log-probs the file recorded: offline RL, and the exact
  reproduction of a run on another world size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor

from scaletune.config.distill import DistillConfig
from scaletune.config.rl import RLConfig
from scaletune.errors import UserError
from scaletune.objectives.logprobs import sampling_logits
from scaletune.strategies.memory import count_bytes

__all__ = [
    "Engine",
    "Generated",
    "HFEngine",
    "LogProbMismatchError",
    "ReplayEngine",
    "SampledLogProbs",
    "completion_mask",
    "make_engine",
]


class LogProbMismatchError(RuntimeError):
    """An engine that samples from the trained weights gave log-probs the trainer does not compute
    (`training.rl.max_logp_mismatch`): the run stops, after the step's metrics line."""


@dataclass
class Generated:
    """What an engine returns for m prompts and n completions each (R = m * n rows, the n of prompt
    i in rows i*n .. i*n+n-1).

    Attributes:
        completions: [R, C] int64 token ids, padded after each completion's end.
        lengths: [R] int64 tokens of each completion, its end-of-sequence token included.
        logprobs: [R, C] float32 log-probability of each token under the distribution it was
            sampled from, softmax(logits / temperature) renormalised on the top_p nucleus; None
            where the engine has none (a replayed file without them). Only the first lengths[r] of
            row r are read.
        entropy: [R, C] float32 entropy of that distribution at each position, in nats; or None.
    """

    completions: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class SampledLogProbs(LogitsProcessor):
    """A logits processor that changes nothing and records, at each generated position, the
    log-probability of the token sampled there and the entropy of the distribution it was sampled
    from: softmax(logits / temperature) on the top_p nucleus (`objectives.logprobs.sampling_logits`,
    which the trainer's log-probs go through too).

    transformers applies a custom processor after its own processors and before the sampling
    warpers (temperature, top_p: `GenerationMixin._get_logits_processor`), so the scores it sees
    are the model's logits (as float32). The token sampled from step t's scores is first seen in
    the input ids of step t + 1 (or, for the last step, in the returned sequences: `finish`), so
    only the previous step's [rows, vocab] log-softmax is kept.
    """

    def __init__(self, temperature: float, top_p: float = 1.0) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.previous: torch.Tensor | None = None
        self.logprobs: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        logp = torch.log_softmax(sampling_logits(scores.float(), self.temperature, self.top_p), dim=-1)
        # p log p is 0 where p is (logp -inf), not nan.
        self.entropy.append(-(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1))
        self.previous = logp
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(1, tokens.unsqueeze(1)).squeeze(1))
            self.previous = None

    def finish(self, sequences: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, width] log-probs, [R, width] entropies) of the `width` generated positions, after
        `generate` returned `sequences` (a position generated after every row had ended is 0)."""
        self._take(sequences[:, -1])
        rows = sequences.size(0)
        out = []
        for values in (self.logprobs, self.entropy):
            got = torch.stack(values, 1).cpu() if values else torch.zeros(rows, 0)
            out.append(torch.nn.functional.pad(got, (0, max(0, width - got.size(1))))[:, :width])
        return out[0], out[1]


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
    returns a :class:`Generated` of m * n rows.

    Attributes:
        samples_policy: it samples from the weights being trained, so its log-probs must equal the
            trainer's (`training.rl.max_logp_mismatch` bounds the difference); False for a replay,
            whose completions an earlier policy sampled.
    """

    name = "engine"
    samples_policy = True
    #: The largest KV cache one `generate` call held, in bytes (memory.json; 0: an engine that holds none).
    kv_cache_bytes = 0

    def generate(self, prompt_ids, prompt_mask, n, *, split: str, step: int, prompt_index) -> Generated:
        raise NotImplementedError

    def update_weights(self) -> None:
        """After an optimizer step: nothing for engines that read the trained module itself."""


class HFEngine(Engine):
    """`generate` of the trained model (`strategy.module.generate`, the causal LM's: the module DDP
    and DeepSpeed ZeRO-1/2 hold whole, whose parameters ZeRO-3's hooks gather for each submodule's
    forward and FSDP2's for each layer's, its root unit gathered around the whole call),
    in eval mode (no dropout), sampling at `temperature` and `top_p` from the whole vocabulary
    (`top_k` 0, no repetition penalty: the model's generation_config is not read), under the
    training forward's autocast (`Strategy.forward_context`), so that it samples from the
    distribution the trainer computes. Its log-probs are recorded as it samples (`SampledLogProbs`).

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
        self.kv_cache_bytes = 0  # the largest KV cache a call held (memory.json's kv_cache)

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
            return_dict_in_generate=True,  # for its KV cache's size
        )
        was_training = model.training
        strategy.train_mode(False)
        seed = self.sampling_seed(split, step)
        recorder = SampledLogProbs(s.temperature, s.top_p)
        try:
            rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            with torch.no_grad(), rng, strategy.forward_context():
                torch.manual_seed(seed)
                out = strategy.module.generate(
                    input_ids=prompt_ids.to(device),
                    attention_mask=prompt_mask.to(device),
                    generation_config=config,
                    logits_processor=[recorder],
                    synced_gpus=self.synced,
                )
        finally:
            strategy.train_mode(was_training)
        cache = [t for layer in getattr(out.cache, "layers", None) or [] for t in (layer.keys, layer.values)]
        self.kv_cache_bytes = max(self.kv_cache_bytes, count_bytes(cache, {}))  # one key, one value a layer
        out = out.sequences
        completions = out[:, prompt_ids.size(1) :].cpu()
        if completions.size(1) == 0:
            completions = torch.full((completions.size(0), 1), self.tokenizer.pad_token_id, dtype=torch.long)
        logprobs, entropy = recorder.finish(out, completions.size(1))
        mask = completion_mask(completions, self.eos)
        return Generated(completions, mask.sum(1), logprobs, entropy)


class ReplayEngine(Engine):
    """Completions read from a rollouts.jsonl: for (split, step, prompt index) the file's lines of
    that key, in file order (the order they were generated), with their `completion_logps` where
    every line has them. `key` names the setting that gave the file in messages
    (`training.rl.replay`, `training.distill.replay`)."""

    name = "replay"
    samples_policy = False

    def __init__(self, path: str | Path, pad_token_id: int, key: str = "training.rl.replay") -> None:
        self.path, self.pad, self.key = Path(path).expanduser(), pad_token_id, key
        self.table: dict[tuple[str, int, int], list[tuple[list[int], list[float] | None]]] = {}
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
                logps = r.get("completion_logps")
                logps = [float(v) for v in logps] if logps is not None else None
                # A log-probability a token: finite and at most 0 (a NaN would reach the agreement check).
                if logps is not None and (len(logps) != len(ids) or not all(-math.inf < v <= 0 for v in logps)):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise UserError(
                    f"{self.key} {self.path}, line {number}: not a rollout (a JSON object with step, "
                    "prompt_index and completion_ids, and completion_logps, if any, one finite log-probability, "
                    "at most 0, a token)",
                    title="invalid data",
                ) from None
            self.table.setdefault(key, []).append((ids, logps))

    def generate(self, prompt_ids, prompt_mask, n, *, split, step, prompt_index):
        rows: list[tuple[list[int], list[float] | None]] = []
        for i in prompt_index.tolist():
            got = self.table.get((split, step, i), [])
            if len(got) < n:
                raise UserError(
                    f"{self.key} {self.path}: {len(got)} completions of prompt {i} at {split} step {step}, "
                    f"need num_generations ({n}); replay with the data, seed and batch sizes of the run that wrote it",
                    title="cannot replay",
                )
            rows += got[:n]
        width = max(1, max(len(ids) for ids, _ in rows))
        out = torch.full((len(rows), width), self.pad, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width) if all(lp is not None for _, lp in rows) else None
        for j, (ids, lp) in enumerate(rows):
            out[j, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            if logprobs is not None and lp:
                logprobs[j, : len(lp)] = torch.as_tensor(lp)
        return Generated(out, torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long), logprobs)


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

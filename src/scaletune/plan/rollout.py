"""What online RL's generation holds per rank (issue 36): the engine's own weights and its KV cache.

The `hf` engine generates with the trained module itself: no second copy of the weights (0 bytes).
Its KV cache, at its largest, is that of one `generate` call (one micro-batch: `micro_batch_size`
prompts x `num_generations` completions, left-padded to the longest prompt) after its last token:

    rows x (prompt + max_new_tokens - 1) x layers x 2 (K and V) x kv_heads x head_dim x bytes

The last sampled token is never fed back, so the cache holds one token fewer than the finished
rows. transformers' DynamicCache keeps one ``[rows, kv_heads, tokens, head_dim]`` key and one value
tensor per layer, in the dtype attention computes in (the run's compute dtype). A prompt is at most
`data.max_seq_length` tokens (a longer one is dropped: `data/prompts.py`). The cache lives only while
the engine generates, before the step's forward, so an entry counts the larger of it and the
training activations (`entry.StrategyPlan.total`). A replay engine holds nothing: its completions
are read from a file.

The stage sampling the most (largest cache) is planned, as `reference_model.py` plans the run's
most expensive reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletune.resolve import FLOAT_DTYPES

if TYPE_CHECKING:
    from scaletune.plan.shapes import ModelShape
    from scaletune.resolve import RunSpec

__all__ = ["RolloutPlan", "rollout_plan"]


@dataclass(frozen=True)
class RolloutPlan:
    """One rank's generation memory for the stage `stage` (engine `engine`).

    Attributes:
        rows: completions one `generate` call holds (micro_batch_size x num_generations).
        prompt_tokens: the longest prompt (`data.max_seq_length`).
        new_tokens: `max_new_tokens`.
        layers, kv_heads, head_dim: the model's (`ModelShape`).
        value_bytes: bytes of one cached value (the compute dtype's).
        engine_weights: bytes of the engine's own copy of the weights (0: the trained module generates).
    """

    engine: str
    stage: str
    rows: int
    prompt_tokens: int
    new_tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    value_bytes: int
    engine_weights: int = 0

    @property
    def cache_tokens(self) -> int:
        """Positions the cache holds at the end of a call: the prompt and every new token but the last."""
        return self.prompt_tokens + self.new_tokens - 1

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one row's one cached position over every layer (keys and values)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.value_bytes

    @property
    def kv_cache(self) -> int:
        """Bytes of the largest KV cache (0 for a replay)."""
        return 0 if self.engine == "replay" else self.rows * self.cache_tokens * self.bytes_per_token

    def arithmetic(self) -> str:
        """The KV-cache term as `scaletune plan` prints it, every factor named."""
        if self.engine == "replay":
            return f"rollout (stage {self.stage}): engine replay reads its completions from a file: no KV cache"
        return (
            f"rollout (stage {self.stage}, engine {self.engine}, whose weights are the trained module's: "
            f"{self.engine_weights} bytes more): KV cache = {self.rows} rows (micro_batch_size x num_generations) "
            f"x ({self.prompt_tokens} prompt + {self.new_tokens} new - 1) tokens x {self.layers} layers x 2 (K, V) "
            f"x {self.kv_heads} kv heads x {self.head_dim} head_dim x {self.value_bytes} bytes "
            f"= {self.kv_cache / 2**20:.2f} MiB per rank, while it generates (counted against the activations)"
        )

    def to_json(self) -> dict:
        return {
            "engine": self.engine,
            "stage": self.stage,
            "rows": self.rows,
            "cache_tokens": self.cache_tokens,
            "bytes_per_token": self.bytes_per_token,
            "kv_cache": self.kv_cache,
            "engine_weights": self.engine_weights,
        }


def rollout_plan(spec: RunSpec, shape: ModelShape) -> RolloutPlan | None:
    """The generation memory of the run's stage that samples the most, or None where no stage
    samples (no grpo or on-policy distillation stage)."""
    plans = []
    for stage in spec.stages:
        sampling = stage.training.sampling
        if sampling is None:
            continue
        plans.append(
            RolloutPlan(
                engine=sampling.engine,
                stage=stage.name,
                rows=spec.batch.micro_batch_size * sampling.num_generations,
                prompt_tokens=stage.data.max_seq_length,
                new_tokens=sampling.max_new_tokens,
                layers=shape.layers,
                kv_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                value_bytes=FLOAT_DTYPES[spec.precision.compute][0],
            )
        )
    return max(plans, key=lambda p: p.kv_cache, default=None)

"""The eval loader and the eval loss over ranks: every rank runs the same number of forwards (FSDP
and ZeRO-3 gather parameters in each), every row counts exactly once, and the loss summed over
ranks is the one-process mean token loss."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from scaletune.data import Collator
from scaletune.data.batching import EvalBatches
from scaletune.data.sources import IGNORE_INDEX


def rows_collator(rows: list[int]) -> list[int]:
    return list(rows)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3])
def test_every_rank_runs_as_many_batches_and_every_row_counts_once(world, micro):
    for n in range(0, 26):
        dataset = list(range(100, 100 + n))
        ranks = [list(EvalBatches(dataset, rows_collator, micro, r, world)) for r in range(world)]
        # The control: the largest share, counted row by row.
        shares = [[i for i in range(n) if i % world == r] for r in range(world)]
        most = max(math.ceil(len(s) / micro) for s in shares)
        assert [len(b) for b in ranks] == [most] * world, (n, world, micro)
        assert all(len(EvalBatches(dataset, rows_collator, micro, r, world)) == most for r in range(world))
        counted = sorted(row for batches in ranks for batch, counts in batches if counts for row in batch)
        assert counted == dataset, (n, world, micro)
        for batches in ranks:  # fillers come last
            flags = [counts for _, counts in batches]
            assert flags == sorted(flags, reverse=True)


class RankStrategy:
    """What `trainer.step.evaluate` calls, for one rank of a simulated job: its all-reduce returns
    the rank's own totals and keeps them, so the test sums the ranks itself."""

    device = torch.device("cpu")
    eval_group = 1  # one micro-batch per forward (no pipeline)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.reduced: list[torch.Tensor] = []
        self.forwards = 0

    def train_mode(self, on: bool) -> None:
        self.model.train(on)

    def move_batch(self, inputs: dict) -> dict:
        return inputs

    def forward_context(self):
        self.forwards += 1
        return contextlib.nullcontext()

    def all_reduce_data(self, value: torch.Tensor) -> torch.Tensor:
        self.reduced.append(value.clone())
        return value

    def split_batch(self, micro_batch: dict) -> dict:
        return micro_batch


def test_eval_loss_summed_over_ranks_is_the_one_process_mean(tiny_model_dir):
    """7 rows over 3 ranks in micro-batches of 2 (shares 3, 2, 2: ranks 1 and 2 run one filler):
    the ranks' summed losses over their summed targets equal Hugging Face's token cross-entropy
    over all rows, each row alone (no padding), within 1e-6."""
    from transformers import AutoModelForCausalLM

    from scaletune.models.loss import CausalLMLoss
    from scaletune.trainer.step import evaluate

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    hf.config.use_cache = False
    rows = []
    for i in range(7):
        ids = torch.randint(5, 1000, (6 + 3 * i,)).tolist()
        labels = [IGNORE_INDEX] * (2 + i % 3) + ids[2 + i % 3 :]
        rows.append({"input_ids": ids, "labels": labels})

    with torch.no_grad():
        loss_sum, targets = 0.0, 0
        for r in rows:
            logits = hf(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1].double()
            shifted = torch.tensor(r["labels"][1:])
            keep = shifted != IGNORE_INDEX
            loss_sum += float(torch.nn.functional.cross_entropy(logits[keep], shifted[keep], reduction="sum"))
            targets += int(keep.sum())
    control = loss_sum / targets

    loss_module = CausalLMLoss(hf)
    collator = Collator(pad_token_id=0)
    strategies = [RankStrategy(loss_module) for _ in range(3)]
    for rank, strategy in enumerate(strategies):
        evaluate(strategy, EvalBatches(rows, collator, 2, rank, 3))
    total = sum(s.reduced[-1] for s in strategies)
    assert [s.forwards for s in strategies] == [2, 2, 2]
    assert int(total[1]) == targets
    assert float(total[0] / total[1]) == pytest.approx(control, rel=1e-6)

"""The tokenised-data cache shared by the processes of a node (issue 20): one writer per cache
entry when processes sharing a cache miss it together (moved from tests/unit/test_data_cache_nodes.py,
whose tests start no process; the turns in which ranks build a stage's data stay there)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from tests.helpers import ALPACA_5000, OLMO2_TOKENIZER

pytestmark = pytest.mark.distributed


def _build_in_a_process(cache: str, out: str, start) -> None:
    """One 'rank' of a node whose cache it shares: build the data when every process is ready, and
    write how many records this process's tokenizing function saw."""
    from transformers import PreTrainedTokenizerFast

    from scaletune.config import DataConfig
    from scaletune.data import build as D

    encoded = []
    real_call = D.Encoder.__call__

    def counting(self, batch):
        encoded.append(len(next(iter(batch.values()))))
        return real_call(self, batch)

    D.Encoder.__call__ = counting
    tok = PreTrainedTokenizerFast(tokenizer_file=str(OLMO2_TOKENIZER), eos_token="<|endoftext|>", pad_token="<|pad|>")
    cfg = DataConfig(train={"path": str(ALPACA_5000), "max_samples": 400}, max_seq_length=256, packing=True)
    start.wait()
    bundle = D.build_datasets(cfg, tok, seed=0, cache_dir=cache)
    Path(out).write_text(f"{sum(encoded)} {len(bundle.train)} {bundle.train[0]['input_ids'][:8]}")


def test_processes_sharing_a_cache_tokenize_it_once(tmp_path):
    """Three processes that miss the same cache entry at the same moment (what the ranks of a
    second node did after global rank 0 had filled only its own node's cache): one tokenizes,
    the others wait and read its files."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(3)
    outs = [tmp_path / f"p{i}.txt" for i in range(3)]
    procs = [ctx.Process(target=_build_in_a_process, args=(str(tmp_path / "cache"), str(out), start)) for out in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = [out.read_text().split(" ", 2) for out in outs]
    encoded = sorted(int(r[0]) for r in results)
    # the up-front check of the first record runs in every process; the whole set in one only
    assert encoded[-1] >= 400 and encoded[:-1] == [1, 1], encoded
    assert len({(r[1], r[2]) for r in results}) == 1  # the same rows everywhere

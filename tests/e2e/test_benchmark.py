"""The benchmark harness (benchmarks/bench.py) in its smoke configuration: every trainer runs (TRL's
SFTTrainer, HF Trainer, the bare loop, scaletune), the numbers it reports are consistent, and
scaletune and the bare loop really train the same model on the same batches. A generous floor, not
a timing claim (docs/benchmarks.md has the measurements). And the FLOPs formula's N, checked
against the parameters of real configs; the attention each trainer's kernel executes, checked
against SDPA's own FLOP count and a block-by-block loop; the datasheet peaks by device name."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT, run_bench


def bench_module():
    spec = importlib.util.spec_from_file_location("bench", REPO_ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_flops_count_the_head_once_tied_or_not():
    """N is every matmul weight: all parameters but the input embedding table, the head included.
    Llama-3.2-1B ties its head to the embeddings (one tensor in the parameter count); Llama-3-8B
    does not. 6N is checked against the sum over the real modules' Linear weights."""
    from transformers import AutoModelForCausalLM

    from scaletune.models import preset_config

    bench = bench_module()
    for preset, tied in (("llama-3.2-1b", True), ("llama-3-8b", False)):
        config = preset_config(preset)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert bool(config.tie_word_embeddings) is tied
        total = sum(p.numel() for p in model.parameters())  # a tied tensor once
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        norms = total - linear - (0 if tied else model.get_input_embeddings().weight.numel())
        n = bench.model_flops_per_token(config, total, total, mean_context=0.0) / 6
        assert n == linear + norms  # the head (tied or not) in, the lookup out
        if tied:  # the old formula, total - V·d, dropped the head: 27% short for Llama-3.2-1B
            assert (linear + norms) / (total - config.vocab_size * config.hidden_size) > 1.25


def _examples_of(position_ids: list[int]) -> list[list[int]]:
    """Token indices of each example of a row: a new one wherever the position does not step by
    1 (transformers' packed-row rule), written out as a loop."""
    spans: list[list[int]] = []
    for i, p in enumerate(position_ids):
        if i == 0 or p != position_ids[i - 1] + 1:
            spans.append([])
        spans[-1].append(i)
    return spans


def _hand_built_batches() -> dict[str, dict]:
    """Padded rows (an attention mask), packed rows (position_ids, padding), and TRL's padding-free
    batch (one row of the whole batch), each made by the real collator."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from scaletune.data import Collator

    def row(*lengths: int) -> dict:
        ids = [7] * sum(lengths)
        return {"input_ids": ids, "labels": ids, "position_ids": [p for n in lengths for p in range(n)]}

    unpacked = [{"input_ids": [7] * n, "labels": [7] * n} for n in (5, 9, 3)]
    return {
        "padded": Collator(0)(unpacked),
        "packed": Collator(0)([row(3, 4), row(6, 2, 1), row(2)]),
        "trl padding-free": DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(
            [{"input_ids": [7] * n} for n in (5, 9, 3, 40)]
        ),
    }


def _sdpa_mask(batch: dict) -> torch.Tensor:
    """The boolean [B, 1, T, T] mask transformers gives SDPA for this batch (same example, causal,
    key not padding), built by loops."""
    rows, length = batch["input_ids"].shape
    mask = torch.zeros(rows, 1, length, length, dtype=torch.bool)
    for b in range(rows):
        pos = batch["position_ids"][b].tolist() if "position_ids" in batch else list(range(length))
        valid = batch["attention_mask"][b].tolist() if "attention_mask" in batch else [1] * length
        for span in _examples_of(pos):
            for q in span:
                for k in span:
                    mask[b, 0, q, k] = k <= q and bool(valid[k])
    return mask


def test_dense_attention_work_is_what_sdpa_computes():
    """A dense kernel computes every score of each (padded) row, masked or not: attention_work
    equals the scores SDPA's math backend materialises, read from torch's FlopCounterMode (its
    two bmm's, QK^T and AV: 4·H·d FLOPs per score), for padded rows, packed rows, and TRL's
    padding-free row, whose square covers every pair of examples in the batch."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    bench = bench_module()
    heads, dim = 2, 8
    for name, batch in _hand_built_batches().items():
        rows, length = batch["input_ids"].shape
        q, k, v = (torch.randn(rows, heads, length, dim) for _ in range(3))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            F.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(batch))
        scores = counter.get_total_flops() / (4 * heads * dim)
        assert bench.attention_work(batch, "dense") == scores == rows * length**2, name
    # The padding-free row's square, against the 57 tokens' examples alone: 1.9x here.
    trl = _hand_built_batches()["trl padding-free"]
    assert bench.attention_work(trl, "dense") == 57**2 and bench.attention_work(trl, "varlen") == 25 + 81 + 9 + 1600


def test_block_attention_work_counts_the_blocks_a_block_mask_keeps():
    """flex_attention with a BlockMask computes the blocks where some query and key share an
    example: counted by a loop over block pairs (small blocks), by torch's own create_block_mask
    over the same rule (128-blocks, rows of 300 tokens), and per example for flash's varlen."""
    from torch.nn.attention.flex_attention import create_block_mask

    from scaletune.data import Collator

    bench = bench_module()
    batches = _hand_built_batches()
    for name, batch in batches.items():
        rows, length = batch["input_ids"].shape
        for block in (2, 4, 5):
            expected = varlen = 0
            for b in range(rows):
                pos = batch["position_ids"][b].tolist() if "position_ids" in batch else [0] * length
                valid = batch["attention_mask"][b].tolist() if "attention_mask" in batch else [1] * length
                if "position_ids" not in batch:
                    pos = list(range(length))
                example = {i: e for e, span in enumerate(_examples_of(pos)) for i in span}
                varlen += sum(sum(valid[i] for i in span) ** 2 for span in _examples_of(pos))
                starts = range(0, length, block)
                for qs in starts:
                    for ks in starts:
                        qb, kb = range(qs, min(qs + block, length)), range(ks, min(ks + block, length))
                        if any(example[i] == example[j] and valid[j] for i in qb for j in kb):
                            expected += block * block
            assert bench.attention_work(batch, "block", block=block) == expected, (name, block)
            assert bench.attention_work(batch, "varlen") == varlen, name
    # 128-blocks, examples across block boundaries, padding at the end of the shorter row.
    lengths = [(100, 90, 60, 50), (130, 70)]
    rows = [
        {"input_ids": [7] * sum(n), "labels": [7] * sum(n), "position_ids": [p for m in n for p in range(m)]}
        for n in lengths
    ]
    batch = Collator(0)(rows)
    seq = torch.zeros(batch["input_ids"].shape, dtype=torch.long)
    for b in range(len(rows)):
        for e, span in enumerate(_examples_of(batch["position_ids"][b].tolist())):
            seq[b, span] = e
    block_mask = create_block_mask(
        lambda b, h, q, k: seq[b, q] == seq[b, k], len(rows), None, seq.shape[1], seq.shape[1], device="cpu"
    )
    kept = int(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
    assert bench.attention_work(batch, "block") == kept * 128 * 128
    assert kept < 2 * 3 * 3  # some blocks are skipped: less than the dense rows' 3 x 3 blocks each


def test_attention_kernel_and_datasheet_peaks():
    """flex_attention skips blocks on CUDA only; flash runs per example; SDPA and eager are dense.
    The datasheet peak is NVIDIA's dense number for a known name and None (unknown, never guessed)
    for the CPU and for names the table lacks (an NVL part, a GH200)."""
    bench = bench_module()
    assert bench.attention_kernel("flex_attention", "cuda") == "block"
    assert bench.attention_kernel("flash_attention_2", "cuda") == "varlen"
    assert [bench.attention_kernel(a, d) for a, d in (("sdpa", "cuda"), ("eager", "cpu"))] == ["dense"] * 2
    peak = bench.datasheet_peak_flops
    assert peak("CPU, 2 cores", "float32") is None and peak("CPU, 2 cores", "bfloat16") is None
    assert peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert peak("NVIDIA H100 80GB HBM3", "float32") == 67e12
    assert peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak("NVIDIA H200", "bfloat16") == 989.4e12
    assert peak("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert peak("NVIDIA A100 80GB PCIe", "float32") == 19.5e12
    assert peak("NVIDIA H100 NVL", "bfloat16") is None and peak("NVIDIA GH200 480GB", "bfloat16") is None
    assert peak("NVIDIA GeForce RTX 4090", "bfloat16") is None


@pytest.mark.slow  # a measurement harness (four trainers); the FLOPs rule above is the CI proof
def test_benchmark_smoke(tmp_path):
    from scaletune.models import preset_config

    r, stdout = run_bench(tmp_path, "smoke", timeout=600)
    t = r["trainers"]
    config = preset_config(r["spec"]["model_preset"])
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    assert set(t) == {"trl", "hf", "bare", "scaletune"}
    steps = r["spec"]["steps"]
    for name, x in t.items():
        assert x["tokens"] > 0 and x["seconds"] > 0, name
        assert math.isclose(x["tokens_per_s"], x["tokens"] / x["seconds"]), name
        assert 0 < x["mfu"] < 1 and 0 < x["hfu"] < 1, name
        # On the CPU there is no datasheet peak: MFU against it is unknown, not a number.
        assert x["mfu_datasheet"] is None, name
        # Every kernel here is SDPA (dense): a row's square covers at least its examples' squares.
        assert x["attention_kernel"] == "dense" and x["attention_span"] >= r["mean_context"], name
        # HFU from the executed FLOPs, written out: 6N with the head counted once (tied or not),
        # 12·L·d per key of the executed span (PaLM), the head's 6·V·d left out at the tokens
        # without a target where the trainer runs it at targets only.
        n = r["parameters"] - (0 if r["tied_head"] else vocab * hidden)
        executed = 6 * n + 12 * layers * hidden * x["attention_work"] / x["tokens"]
        if name in ("scaletune", "bare"):
            executed -= 6 * vocab * hidden * (1 - r["target_fraction"])
        assert math.isclose(x["hfu"], x["tokens_per_s"] * executed / r["peak"]["flops_per_s"], rel_tol=1e-9), name
        # MFU and HFU differ only in the FLOPs counted: where the trainer runs the head at every
        # token, its executed attention (>= the model's) makes HFU >= MFU. scaletune and the bare
        # loop skip the head at tokens without a target, so theirs may be below MFU.
        if name in ("trl", "hf"):
            assert x["hfu"] >= x["mfu"], name
        assert x["peak_memory_bytes"] > 2**20, name
        # A random model starts at the uniform loss, ln(vocab): the same model in all three.
        assert abs(x["first_loss"] - math.log(100_352)) < 0.5, (name, x["first_loss"])
    # Same weights, same sampler, same loss: the bare loop's first step is scaletune's first step.
    assert math.isclose(t["bare"]["first_loss"], t["scaletune"]["first_loss"], rel_tol=1e-5)
    # Packed rows of at most micro x seq tokens per step: the token count cannot exceed that.
    assert t["scaletune"]["tokens"] <= steps * r["spec"]["micro_batch_size"] * r["spec"]["max_seq_length"]
    assert t["scaletune"]["tokens"] == t["bare"]["tokens"]
    assert r["peak"]["flops_per_s"] > 1e9
    assert r["speedup_vs_hf"] > 0.5 and r["speedup_vs_trl"] > 0.5 and r["overhead_vs_bare"] < 0.5  # generous floors
    assert "scaletune / TRL SFTTrainer" in stdout and "MFU" in stdout
    assert r["datasheet_peak_flops"] is None and "unknown for this device" in stdout
    assert "MFU-ds" in stdout and "attn span" in stdout and " n/a " in stdout
    # TRL's padding-free batch is one dense row of every example of the micro-batch: more keys per
    # token than scaletune's rows of at most max_seq_length, and the report shows it.
    assert t["trl"]["attention_span"] > t["scaletune"]["attention_span"]
    assert t["trl"]["attention_span"] > r["spec"]["max_seq_length"]
    # The head runs at target positions only in scaletune: fewer FLOPs executed than the model's.
    assert r["executed_flops_per_token"] < r["flops_per_token"] and 0 < r["target_fraction"] < 1

"""strategies.parallel.context without processes: `split_batch` on real collated batches (the
slices put back together are the padded batch; the loop's target and token counts summed over
the slices are the whole batch's), the mask of whole packed rows, and `CausalLMLoss` on a
one-rank "slice" against the same model on the whole micro-batch. The multi-rank attention is
tested in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from scaletune.data.batching import Collator
from scaletune.models.attention import context_mask, packed_mask
from scaletune.models.loss import CausalLMLoss
from scaletune.strategies.parallel.context import split_batch
from scaletune.trainer.batches import TEXT, model_inputs


def row(n: int, prompt: int, start: int = 1, positions: list[int] | None = None) -> dict:
    ids = [(start + 7 * i) % 97 + 3 for i in range(n)]
    out = {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}
    if positions is not None:
        out["position_ids"] = positions
    return out


def unpacked_batch() -> dict:
    return Collator(pad_token_id=0)([row(13, 4), row(9, 2, 5), row(5, 0, 9)])


def packed_batch() -> dict:
    """Two packed rows; with cp 2 (slices of 8) the first slice of row 0 ends on an example's
    first token (position 0), where counting tokens by positions alone would miss one."""
    first = list(range(7)) + list(range(4)) + list(range(4))  # examples of 7, 4, 4 tokens
    second = list(range(6)) + list(range(5))
    return Collator(pad_token_id=0)([row(15, 0, 1, first), row(11, 0, 4, second)])


def padded(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, length - t.size(1)), value=value)


@pytest.mark.parametrize("make", [unpacked_batch, packed_batch])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_slices_put_back_are_the_padded_batch_and_count_the_same(make, cp):
    mb = make()
    packed = "attention_mask" not in mb
    slices = [split_batch(mb, r, cp) for r in range(cp)]
    local = slices[0]["input_ids"].size(1)
    length = local * cp
    assert length >= mb["input_ids"].size(1) > length - cp
    for key, value in (("input_ids", 0), ("position_ids", 0)):
        assert torch.equal(torch.cat([s[key] for s in slices], 1), padded(mb[key], length, value)), key
    labels = padded(mb["labels"], length + 1, -100)
    for r, s in enumerate(slices):
        assert torch.equal(s["labels"], labels[:, r * local : (r + 1) * local + 1])
        assert "target_index" not in s  # it indexed the whole rows; model_inputs computes the slice's
        index = model_inputs(s)["target_index"]  # what the loss gets (its values: the test below)
        assert index.numel() == 0 or int(index.max()) < mb["input_ids"].size(0) * local
        assert ("full_position_ids" in s) == packed
        if packed:
            assert torch.equal(s["full_position_ids"], padded(mb["position_ids"], length, 0))
    assert sum(TEXT.targets(s) for s in slices) == TEXT.targets(mb)
    assert sum(TEXT.tokens(s) for s in slices) == TEXT.tokens(mb)


def test_the_loss_gets_each_slices_own_targets():
    """The target index the loss gets on each context rank, written out by hand for the unpacked
    batch at cp 2 (rows of 13, 9 and 5 tokens whose first 4, 2 and 0 are prompt: labels -100 there
    and in the padding). T = 13, so L = 7 and rank r holds positions [7r, 7r + 7) with the labels
    of [7r, 7r + 8) (one past the slice). Local position t of row b is index 7b + t when its next
    token's label, at position 7r + t + 1, is a target (row 0: 4..12, row 1: 2..8, row 2: 0..4):
    rank 0: row 0 t = 3..6, row 1 t = 1..6 -> 8..13, row 2 t = 0..3 -> 14..17;
    rank 1: row 0 t = 0..4 (positions 8..12), row 1 t = 0 (position 8) -> 7, row 2 none."""
    mb = unpacked_batch()
    want = {0: [3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], 1: [0, 1, 2, 3, 4, 7]}
    for rank, index in want.items():
        assert model_inputs(split_batch(mb, rank, 2))["target_index"].tolist() == index, rank


def test_the_packed_boundary_case_is_there():
    """The control for the token count: slice 0 of row 0 ends on position 0 (an example's first
    token), so the collator's position rule would count one token short on that slice."""
    s = split_batch(packed_batch(), 0, 2)
    assert int(s["position_ids"][0, -1]) == 0 and int(s["attention_mask"][0, -1]) == 1


def test_rows_without_position_ids_get_them_explicitly():
    mb = {k: v for k, v in unpacked_batch().items() if k != "position_ids"}
    s = split_batch(mb, 1, 2)
    assert torch.equal(s["position_ids"], torch.arange(7, 14).expand(3, 7))


def test_refused_batches():
    mb = unpacked_batch()
    left = {**mb, "attention_mask": mb["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="right padding"):
        split_batch(left, 0, 2)
    with pytest.raises(ValueError, match="chosen_input_ids"):
        split_batch({**mb, "chosen_input_ids": mb["input_ids"]}, 0, 2)
    with pytest.raises(ValueError, match="not in a group"):
        split_batch(mb, 2, 2)


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_context_mask_is_the_whole_rows_packed_mask():
    """Control: the mask `packed_mask` gives the whole packed micro-batch of an sdpa model."""
    model = tiny_llama()
    mb = packed_batch()
    full = split_batch(mb, 0, 1)["full_position_ids"]
    assert context_mask(model.config, None) is None
    assert torch.equal(context_mask(model.config, full), packed_mask(model.config, mb["position_ids"]))


@pytest.mark.parametrize("make", [unpacked_batch, packed_batch])
def test_a_one_rank_slice_scores_every_target_of_the_whole_batch(make):
    """With one context rank the "slice" is the whole (padded) row with labels one longer: the
    loss and gradients must be those of the whole micro-batch (the plain CausalLMLoss path)."""
    mb = make()
    module = CausalLMLoss(tiny_llama())
    whole = module(**model_inputs(mb))
    whole.backward()
    expected = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    s = split_batch(mb, 0, 1)
    sliced = module(**model_inputs(s))
    sliced.backward()
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=0)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-6, msg=n)

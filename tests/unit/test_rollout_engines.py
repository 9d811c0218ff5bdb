"""The hf engine's record of what it sampled (`rollout.engines.SampledLogProbs`): the log-prob of
each sampled token and the entropy at each position are those of the distribution it sampled from,
the model's own logits (which transformers returns beside the sequences, `output_logits`) at the
sampling temperature, renormalised on the top_p nucleus, computed here by hand. A tiny random Llama
samples 3 completions of 2 prompts. And the replay engine's reading of a rollouts.jsonl it is given
(`rollout.engines.ReplayEngine`): log-probs no engine gives are refused, by line."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from scaletune.rollout.engines import SampledLogProbs

TEMPERATURE, TOP_P, NEW = 0.7, 0.9, 6


def nucleus_log_probs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """log softmax(logits) renormalised on the nucleus: a token is kept while the tokens more
    likely than it hold less than top_p of the mass (Holtzman et al. 2019); -inf elsewhere."""
    probs = logits.softmax(-1)
    order = probs.argsort(-1, descending=True)
    ranked = probs.gather(-1, order)
    keep = torch.zeros_like(ranked, dtype=torch.bool).scatter(-1, order, (ranked.cumsum(-1) - ranked) < top_p)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return (kept / kept.sum(-1, keepdim=True)).log()


def test_recorded_log_probs_and_entropy_are_of_the_nucleus_sampled_from():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompts = torch.randint(3, 97, (2, 5))
    recorder = SampledLogProbs(TEMPERATURE, TOP_P)
    sampling = GenerationConfig(
        do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0, max_new_tokens=NEW, num_return_sequences=3,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            generation_config=sampling,
            logits_processor=[recorder],
            output_logits=True,
            return_dict_in_generate=True,
        )
    width = out.sequences.size(1) - prompts.size(1)
    logprobs, entropy = recorder.finish(out.sequences, width)
    assert logprobs.shape == entropy.shape == (6, width) and width >= 1
    raw = torch.stack(out.logits, 1).float() / TEMPERATURE  # [6, width, 97]: before any processor
    nucleus = nucleus_log_probs(raw, TOP_P)
    sampled = out.sequences[:, prompts.size(1) :]
    expected = nucleus.gather(2, sampled.unsqueeze(2)).squeeze(2)
    assert torch.isfinite(expected).all()  # every sampled token is in its nucleus
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=nucleus).entropy(), rtol=0, atol=1e-5)
    # the nucleus is a real cut: below the whole distribution's entropy, above 0
    whole = torch.distributions.Categorical(logits=raw).entropy()
    assert (entropy > 0).all() and (entropy < whole - 1e-3).all()


def test_positions_no_step_reached_are_zero():
    """A rank of a synced generation that stopped first has fewer recorded steps than the width."""
    recorder = SampledLogProbs(1.0)
    scores = torch.log_softmax(torch.randn(2, 5), -1)
    recorder(torch.tensor([[1], [2]]), scores)
    logprobs, entropy = recorder.finish(torch.tensor([[1, 3], [2, 4]]), 3)
    assert logprobs.shape == (2, 3) and (logprobs[:, 1:] == 0).all() and (entropy[:, 1:] == 0).all()
    torch.testing.assert_close(logprobs[:, 0], scores[[0, 1], [3, 4]])


def test_a_replay_file_with_log_probs_no_engine_gives_is_refused_by_line(tmp_path):
    """`training.rl.replay` is input from anywhere: a line whose `completion_logps` hold NaN,
    infinity or a positive number (no log-probability is) is named by its line, as a wrong count
    is; a file of real ones loads and replays them."""
    import json
    import math

    import pytest

    from scaletune.errors import UserError
    from scaletune.rollout.engines import ReplayEngine

    good = {"step": 1, "prompt_index": 0, "completion_ids": [5, 6], "completion_logps": [-0.5, -2.0]}
    for bad in ([math.nan, -1.0], [-1.0, math.inf], [0.25, -1.0], [-1.0]):
        path = tmp_path / "rollouts.jsonl"
        line = json.dumps({**good, "completion_logps": bad})  # NaN and Infinity as Python's json writes them
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(UserError, match="line 2: not a rollout"):
            ReplayEngine(path, pad_token_id=0)
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    got = ReplayEngine(path, pad_token_id=0).generate(
        None, None, 2, split="train", step=1, prompt_index=torch.tensor([0])
    )
    assert got.completions.tolist() == [[5, 6], [5, 6]] and got.logprobs.tolist() == [[-0.5, -2.0]] * 2

"""Pipeline stages (`strategies/parallel/pipeline.split_stage`) of tiny Llama and OLMo-2 models.

The split: every parameter of the model in exactly one stage under its own name (the `CausalLMLoss`
names, so DCP checkpoints reshard across pipeline degrees), the layers contiguous and even,
embeddings on the first stage and norm + head on the last. The stages' forwards run one after
another in this process must give `CausalLMLoss`'s summed token loss and gradients (the control:
the unsplit model), for right-padded rows and for packed rows, with gradient checkpointing too.
"""

from __future__ import annotations

import pytest
import torch

from scaletune.models.loss import CausalLMLoss, target_index
from scaletune.strategies.parallel.pipeline import split_stage, stage_layers

SIZES = dict(
    hidden_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=64,
)


def build(family: str = "llama", *, tied: bool = False, meta: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig, Olmo2Config

    if family == "olmo2":
        config = Olmo2Config(**SIZES, attn_implementation="sdpa")
    else:
        config = LlamaConfig(**SIZES, tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_stage_layers_even_and_contiguous():
    assert [list(stage_layers(5, s, 2)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(5, s, 3)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layers(2, 0, 3)
    with pytest.raises(ValueError, match="outside"):
        stage_layers(4, 2, 2)


@pytest.mark.parametrize("family", ["llama", "olmo2"])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_split_keeps_every_name_once(family, num_stages):
    want = sorted("causal_lm." + n for n in build(family, meta=True).state_dict())
    seen: list[str] = []
    for s in range(num_stages):
        stage = split_stage(build(family, meta=True), s, num_stages)
        names = list(stage.state_dict())
        seen += names
        layers = sorted({int(n.split(".")[3]) for n in names if ".layers." in n})
        assert layers == list(stage_layers(SIZES["num_hidden_layers"], s, num_stages))
        assert ("causal_lm.model.embed_tokens.weight" in names) == (s == 0)
        assert ("causal_lm.lm_head.weight" in names) == (s == num_stages - 1)
        assert ("causal_lm.model.norm.weight" in names) == (s == num_stages - 1)
    assert sorted(seen) == want  # the union is the model, nothing twice


def test_tied_head_refused():
    with pytest.raises(ValueError, match="untied head"):
        split_stage(build(tied=True, meta=True), 0, 2)
    split_stage(build(tied=True, meta=True), 0, 1)  # one stage: nothing to split


def test_sliding_window_refused():
    from transformers import AutoModelForCausalLM, MistralConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(MistralConfig(**SIZES, sliding_window=8))
    with pytest.raises(ValueError, match="plain causal attention"):
        split_stage(model, 0, 2)


def test_peft_names_kept():
    from peft import LoraConfig, get_peft_model

    def lora():
        return get_peft_model(build(meta=True), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    want = sorted("causal_lm." + n for n, _ in lora().named_parameters())
    seen = [n for s in range(2) for n, _ in split_stage(lora(), s, 2).named_parameters()]
    assert sorted(seen) == want


def batch(packed: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (3, 14), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:
        out["position_ids"] = torch.cat([torch.arange(6), torch.arange(8)]).repeat(3, 1)
        labels[:, 6] = -100
    else:
        mask = torch.ones_like(ids)
        mask[1, 9:], ids[1, 9:], labels[1, 9:] = 0, 0, -100
        mask[2, 12:], ids[2, 12:], labels[2, 12:] = 0, 0, -100
        out["attention_mask"] = mask
    return out


@pytest.mark.parametrize(
    ("family", "packed", "checkpointing"),
    [("llama", False, False), ("llama", True, False), ("olmo2", False, False), ("olmo2", True, True)],
    ids=["llama-padded", "llama-packed", "olmo2-padded", "olmo2-packed-checkpointed"],
)
def test_stages_in_sequence_match_the_loss_module(family, packed, checkpointing):
    def model():
        m = build(family)
        if checkpointing:  # the layers, called directly by the stages, still recompute in backward
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    mb = batch(packed)
    control = CausalLMLoss(model(), chunk=8)
    want = control(
        mb["input_ids"], mb["labels"], target_index(mb["labels"]), mb.get("attention_mask"), mb.get("position_ids")
    )
    want.backward()
    want_grads = {n: p.grad for n, p in control.named_parameters()}

    stages = [split_stage(model(), s, 3, chunk=8) for s in range(3)]
    x = mb["input_ids"]
    for stage in stages:
        x = stage(x, position_ids=mb.get("position_ids"), labels=mb["labels"])
    x.backward()
    torch.testing.assert_close(x, want, rtol=1e-5, atol=0)
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-4, atol=1e-6)

"""Pipeline stages (`strategies/parallel/pipeline.split_stage`) of tiny Llama and OLMo-2 models.

The split: every parameter of the model in exactly one stage under its own name (the `CausalLMLoss`
names, so DCP checkpoints reshard across pipeline degrees), the layers contiguous and even,
embeddings on the first stage and norm + head on the last. The stages' forwards run one after
another in this process must give `CausalLMLoss`'s summed token loss and gradients (the control:
the unsplit model), for right-padded rows and for packed rows, with gradient checkpointing too.

And the environment and the runner: torch older than 2.11 refused at the split, transformers 5.17's
`create_causal_mask` signature taken, and `PipelineRunner` (a one-stage 1F1B on a one-process gloo
group) padding its steps to one shape: the stage built once, the loss and gradients unchanged.
"""

from __future__ import annotations

import re

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


def test_mask_call_fits_transformers_5_17(monkeypatch):
    """The GPU machines' transformers 5.17 names create_causal_mask's cache `past_key_values` (5.24:
    `cache`): the stage passes it by position, so both signatures take the call."""
    import transformers.masking_utils as masking

    seen = []

    def signature_5_17(config, inputs_embeds, attention_mask, past_key_values, position_ids=None, **kwargs):
        seen.append((past_key_values, position_ids))
        return None  # sdpa's plain causal attention

    monkeypatch.setattr(masking, "create_causal_mask", signature_5_17)
    mb = batch(False)
    stage = split_stage(build(), 0, 1, chunk=8)
    assert stage(mb["input_ids"], labels=mb["labels"]).ndim == 0
    assert seen == [(None, None)]


# --- torch version floor (issue 38 item 4) and the runner's one padded shape (item 11) ---


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.11.0", "2.12.0a0+git1234abc", "2.13.0+cpu", "3.0.0"])
def test_torch_from_2_11_accepted(version):
    from scaletune.strategies.parallel.pipeline import require_pipelining_torch

    require_pipelining_torch(version)


@pytest.mark.parametrize("version", ["2.10.1+cu128", "2.6.0", "1.13.1", "nightly"])
def test_older_torch_refused_with_the_version(version):
    from scaletune.strategies.parallel.pipeline import require_pipelining_torch

    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.11, found torch " + re.escape(version)):
        require_pipelining_torch(version)


def test_split_refuses_old_torch_at_setup(monkeypatch):
    """The check runs where a strategy splits its model (setup, before any step): more than one stage only."""
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.11"):
        split_stage(build(meta=True), 0, 2)
    split_stage(build(meta=True), 0, 1)  # one stage: no pipelining API involved


def test_padded_length_buckets():
    from scaletune.strategies.parallel.pipeline import padded_length

    assert [padded_length(n) for n in (1, 8, 9, 14, 16, 17, 100, 1000, 1024, 1025)] == [
        8, 8, 16, 16, 16, 24, 112, 1024, 1024, 1280
    ]  # fmt: skip
    for n in range(1, 5000):
        p = padded_length(n)
        assert n <= p and padded_length(p) == p  # idempotent: a grown shape keeps its length
        assert p - n < (8 if n <= 32 else n / 4)  # never a quarter more positions past 32


@pytest.fixture
def one_rank_group():
    """A one-process gloo group in this process (a HashStore: nothing started, no port opened)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def rows(lengths: list[int], seed: int, packed: bool) -> dict:
    """A right-padded micro-batch (Collator's layout) of rows with these real lengths; the first 2
    tokens of each row are untrained (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    positions = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 256, (n,), generator=g)
        labels[i, 2:n] = ids[i, 2:n]
        mask[i, :n] = 1
        positions[i, :n] = torch.arange(n)
    if packed:  # two examples in the first row
        positions[0, : lengths[0]] = torch.cat([torch.arange(3), torch.arange(lengths[0] - 3)])
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def summed(control: CausalLMLoss, mb: dict) -> torch.Tensor:
    """The loss module's summed token loss of one unpadded micro-batch."""
    labels = mb["labels"]
    return control(mb["input_ids"], labels, target_index(labels), mb.get("attention_mask"), mb.get("position_ids"))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_runner_pads_to_one_shape_builds_once_and_keeps_the_loss(monkeypatch, one_rank_group, packed):
    """A one-stage 1F1B over steps whose longest rows differ (14, 9, 12, 5): the stage is built once
    (padded to [3, 16]), each step's loss and gradients are the unpadded loss module's; a longer step
    (20) grows the shape once; evaluation builds its own stage once and leaves training's alone."""
    import torch.distributed.pipelining as pipelining

    from scaletune.strategies.parallel.pipeline import PipelineRunner

    built: list[int] = []

    class CountedStage(pipelining.PipelineStage):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pipelining, "PipelineStage", CountedStage)
    control = CausalLMLoss(build(), chunk=8)
    runner = PipelineRunner(split_stage(build(), 0, 1, chunk=8), 0, 1, one_rank_group, torch.device("cpu"), 2)
    steps = [([14, 11], [6, 9, 7]), ([9], [8, 4]), ([12, 12], [3, 10]), ([5, 4], [5, 5])]
    for i, (a, b) in enumerate([*steps, ([20, 6, 5], [7])]):
        mbs = [rows(a, 2 * i, packed), rows(b, 2 * i + 1, packed)]
        denominator = torch.tensor(float(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)))
        control.zero_grad(set_to_none=True)
        runner.module.zero_grad(set_to_none=True)
        want = sum(summed(control, mb) for mb in mbs) / denominator
        want.backward()
        got = runner.step(mbs, denominator)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
        grads = dict(control.named_parameters())
        for name, p in runner.module.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6)
        assert runner._built[True][0] == ((3, 16, packed) if i < len(steps) else (3, 24, packed))
        assert len(built) == (1 if i < len(steps) else 2), f"step {i}: the stage was rebuilt"
    with torch.no_grad():
        for j, (a, b) in enumerate(steps):
            mbs = [rows(a, 20 + j, packed), rows(b, 30 + j, packed)]
            want = sum(summed(control, mb) for mb in mbs)
            torch.testing.assert_close(runner.forward_only(mbs), want, rtol=1e-5, atol=0)
    assert len(built) == 3 and runner._built[False][0] == (3, 16, packed)
    runner.step([rows([9], 0, packed), rows([4], 1, packed)], torch.tensor(9.0))
    assert len(built) == 3  # training's schedule is still the one built for (3, 24)

"""scaletune.models.attention: the attention a run with packed rows uses, and the mask each packed
micro-batch gets (built once, handed to transformers as 4D).

The controls are transformers' own packed-row masking (`attention_mask=None` with restarting
position_ids: `masking_utils.find_packed_sequence_indices` and its dense SDPA mask), never the code
under test. Models: tiny Llama and OLMo-2 from their `transformers` configs, random fp32 weights.

flex_attention on the CPU: torch refuses its backward there ("FlexAttention does not support
backward on CPU"), so the gradient parity runs flex_attention's eager reference (the higher-order
op's math implementation and autograd, which torch tests its compiled kernels against) with that
device guard lifted; the compiled CPU kernel, which skips masked blocks by the BlockMask, is checked
on the forward in tests/e2e/test_compile.py (compiling is too slow for this tier). The Triton kernels
of a GPU are checked by the CUDA test at the end (skipped here).
"""

from __future__ import annotations

import pytest
import torch

from scaletune.config import ModelConfig
from scaletune.models import PRESETS
from scaletune.models.attention import packed_attention, packed_mask, sequence_ids
from tests.attention_cases import LENGTHS, TOL, T, packed_batch, scaletune_mean_loss, tiny, transformers_mean_loss


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """flex_attention's eager reference with its autograd on the CPU (module docstring): torch's
    CPU-backward guard lifted, transformers' torch.compile wrappers (of flex_attention, and of
    create_block_mask where transformers builds its own block mask) replaced by the eager calls."""
    import torch.nn.attention.flex_attention as fa
    import transformers.integrations.flex_attention as tfa
    import transformers.masking_utils as mu

    monkeypatch.setattr(fa, "_validate_device", lambda q, k, v: None)
    monkeypatch.setattr(
        tfa, "compile_friendly_flex_attention", lambda q, k, v, training=False, **kw: fa.flex_attention(q, k, v, **kw)
    )
    monkeypatch.setattr(mu, "create_block_mask", lambda *a, **kw: fa.create_block_mask(*a, **{**kw, "_compile": False}))


def test_sequence_ids_follow_transformers():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = packed_batch(512)["position_ids"]
    assert torch.equal(sequence_ids(pos), find_packed_sequence_indices(pos))


@pytest.mark.parametrize("preset", ["llama-tiny", "olmo2-tiny"])
def test_sdpa_mask_is_transformers_mask(preset):
    """The prebuilt SDPA mask is exactly the one transformers builds for packed rows, so the SDPA
    path's losses do not move by a bit."""
    from transformers.masking_utils import create_causal_mask

    model = tiny(preset, "sdpa")
    pos = packed_batch(512)["position_ids"]
    embeds = torch.zeros(*pos.shape, model.config.hidden_size)
    theirs = create_causal_mask(model.config, embeds, None, None, position_ids=pos)
    ours = packed_mask(model.config, pos)
    assert ours.dtype == theirs.dtype == torch.bool and torch.equal(ours, theirs)
    # Not the plain causal mask: examples are kept apart.
    assert not torch.equal(ours, torch.ones(T, T, dtype=torch.bool).tril().expand_as(ours))


@pytest.mark.parametrize("preset", ["llama-tiny", "olmo2-tiny"])
def test_flex_loss_and_gradients_equal_dense_sdpa(preset, flex_backward_on_cpu):
    """fp32, CPU: the trainer's loss module over flex_attention with its block mask gives the loss and
    every parameter gradient of transformers' dense-mask SDPA path within 1e-5."""
    batch = packed_batch(512)
    control = tiny(preset, "sdpa")
    transformers_mean_loss(control, batch).backward()
    flex = tiny(preset, "flex_attention")
    assert flex.config._attn_implementation == "flex_attention"
    loss = scaletune_mean_loss(flex, batch)
    loss.backward()
    want, got = transformers_mean_loss(control, batch).detach(), loss.detach()
    assert abs(float(got - want)) <= TOL, f"loss {float(got)} vs {float(want)}"
    g_want, g_got = grads(control), grads(flex)
    worst = max((g_got[k] - g_want[k]).abs().max().item() for k in g_want)
    assert worst <= TOL, f"largest gradient difference {worst}"
    assert all(g.abs().sum() > 0 for g in g_got.values()), "every parameter gets a gradient"

    # The comparison can fail: the same rows without position resets (one example per row, so the
    # block mask lets the examples see each other) move the loss far beyond the tolerance.
    leaky = dict(batch, position_ids=torch.arange(T).expand(len(LENGTHS), T))
    with torch.no_grad():
        assert abs(float(scaletune_mean_loss(flex, leaky) - want)) > 100 * TOL


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_transformers_skips_its_packed_mask_work(attn, monkeypatch, flex_backward_on_cpu):
    """With the prebuilt mask, transformers never looks for packed rows (the per-forward `.all()`
    host sync of `find_packed_sequence_indices`); without it, it does (the check can fail)."""
    import transformers.masking_utils as mu

    calls = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda pos: calls.append(1) or real(pos))
    model, batch = tiny("llama-tiny", attn), packed_batch(512)
    scaletune_mean_loss(model, batch).backward()
    assert calls == []
    transformers_mean_loss(model, batch)
    assert calls == [1]


def test_models_with_windowed_layers_keep_transformers_masks():
    model = tiny("llama-tiny", "sdpa")
    pos = packed_batch(512)["position_ids"]
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert packed_mask(model.config, pos) is None
    model.config._attn_implementation = "eager"
    model.config.layer_types = ["full_attention", "full_attention"]
    assert packed_mask(model.config, pos) is None


def choice(caplog, *, packing=True, device="cuda:0", preset="olmo2-tiny", **model) -> tuple[str | None, str]:
    caplog.clear()
    with caplog.at_level("INFO", logger="scaletune"):
        got = packed_attention(
            ModelConfig(name_or_path="x", **model), PRESETS[preset].config(), packing=packing, device=device
        )
    return got, caplog.text


def test_the_choice_rule(caplog):
    # Packed rows, attention left at its default: flex_attention on CUDA, sdpa on the CPU; said once.
    got, said = choice(caplog)
    assert got == "flex_attention" and "attention for packed rows: flex_attention" in said
    got, said = choice(caplog, device="cpu")
    assert got == "sdpa" and "no flex_attention backward on the CPU" in said
    # A written value is kept, whatever the device.
    got, said = choice(caplog, attn_implementation="sdpa")
    assert got == "sdpa" and "(model.attn_implementation)" in said
    assert choice(caplog, attn_implementation="eager")[0] == "eager"
    # No packing: nothing chosen, nothing said.
    assert choice(caplog, packing=False) == ("sdpa", "")
    # Where transformers' flex path would refuse to train the model, sdpa.
    import transformers

    from scaletune.models import attention

    assert "attention dropout" in attention.flex_unavailable(
        PRESETS["olmo2-tiny"].config(attention_dropout=0.1), "cuda:0"
    )
    assert "does not support flex_attention" in attention.flex_unavailable(transformers.CLIPConfig(), "cuda:0")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_a_run_on_gpus_decides_for_the_ranks_gpu_not_the_load_device(caplog, strategy):
    """The choice a run on 2 GPUs makes (rank 1, CUDA pretended, nothing loaded): FSDP and DeepSpeed
    load the weights on the CPU (`placement.device`) and move them to the GPU themselves; the choice
    follows the GPU the rank computes on. Deciding it for the load device gave these runs sdpa and
    the line "no flex_attention backward on the CPU" (issue 38)."""
    from scaletune.resolve import resolve
    from scaletune.strategies import make_strategy
    from scaletune.trainer.model_source import PretrainedSource
    from tests.helpers import make_config, make_env

    cfg = make_config(
        "olmo2-tiny",  # a preset: its transformers config is read without a folder
        "runs/x",
        as_config=True,
        model={"attn_implementation": None, "dtype": "bfloat16"},
        data={"packing": True},
        distributed={"strategy": strategy, "num_processes": 2},
    )
    made = make_strategy(resolve(cfg, make_env(2, rank=1, gpus=2)))
    assert str(made.device) == "cuda:1"
    caplog.clear()
    with caplog.at_level("INFO", logger="scaletune"):
        assert PretrainedSource(made.spec).attention(made) == "flex_attention"
    assert "attention for packed rows: flex_attention" in caplog.text and "on the CPU" not in caplog.text
    if strategy != "ddp":  # the control: the load device, which the choice was made for before
        assert made.placement.device == "cpu"


def test_flex_under_autocast_gets_one_dtype(tiny_model_dir, monkeypatch):
    """A run that loads with flex_attention registers the autocast cast (issue 38): under
    `torch.autocast` a Llama hands attention fp32 queries and keys (its rotary embedding follows the
    fp32 residual stream) and a bf16 value; flex_attention must see one dtype, the autocast one, and
    give SDPA's answer (SDPA is on autocast's list). Forward only: the CPU has no flex backward."""
    import transformers.integrations.flex_attention as tfa
    from transformers import AttentionInterface

    from scaletune.models import load_model
    from scaletune.models.attention import flex_attention_in_autocast_dtype
    from scaletune.models.placement import DevicePlacement

    monkeypatch.setitem(AttentionInterface._global_mapping, "flex_attention", tfa.flex_attention_forward)
    load_model(
        ModelConfig(name_or_path=str(tiny_model_dir), attn_implementation="flex_attention"),
        DevicePlacement(None, "cpu"),
    )
    assert AttentionInterface._global_mapping["flex_attention"] is flex_attention_in_autocast_dtype

    seen, real = [], tfa.flex_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(tfa, "flex_attention_forward", spy)
    flex, control = tiny("llama-tiny", "flex_attention"), tiny("llama-tiny", "sdpa")
    ids = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = flex(input_ids=ids).logits, control(input_ids=ids).logits
    assert seen and set(seen) == {(torch.bfloat16,) * 3}, seen
    diff = (got.float() - want.float()).abs()  # logits of about +-2, each path rounding to bf16
    assert diff.mean().item() < 5e-3 and diff.max().item() < 0.1, (diff.mean().item(), diff.max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["llama-tiny", "olmo2-tiny"])
def test_flex_on_cuda_equals_dense_sdpa(preset):
    """On a GPU, transformers' compiled flex_attention (Triton kernels, forward and backward) with
    the block mask against the dense-mask SDPA path: fp32 loss and gradients within 1e-5."""
    batch = {k: v.cuda() for k, v in packed_batch(512).items()}
    control, flex = tiny(preset, "sdpa").cuda(), tiny(preset, "flex_attention").cuda()
    transformers_mean_loss(control, batch).backward()
    loss = scaletune_mean_loss(flex, batch)
    loss.backward()
    assert abs(float(loss - transformers_mean_loss(control, batch))) <= TOL
    g_want, g_got = grads(control), grads(flex)
    assert max((g_got[k] - g_want[k]).abs().max().item() for k in g_want) <= TOL

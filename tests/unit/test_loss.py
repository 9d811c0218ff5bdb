"""scaletune.models.loss: the chunked head+loss against plain cross-entropy, CausalLMLoss against the
model's own `labels=` loss on tiny real Hugging Face models, activation offloading, and Liger's
fused linear cross-entropy (GPU only)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletune.models.loss import IGNORE_INDEX, CausalLMLoss, chunked_head_cross_entropy, target_index

TOL = 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise difference relative to the largest magnitude of `expected`."""
    scale = expected.detach().abs().max().clamp_min(1e-30)
    return float((actual.detach() - expected.detach()).abs().max() / scale)


def assert_grads_close(actual, expected, names, tol=TOL):
    for name, a, e in zip(names, actual, expected, strict=True):
        assert a is not None and e is not None, f"{name}: no gradient"
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
        if e.numel():
            err = rel_err(a, e)
            assert err <= tol, f"{name}: gradient differs by {err:.2e} (relative) > {tol:.0e}"


# ---------------------------------------------------------------------------------------------
# chunked_head_cross_entropy against F.cross_entropy(head(hidden), targets, reduction="sum")

HIDDEN, VOCAB, CHUNK = 16, 50, 8


@pytest.mark.parametrize("n", [21, 5, 16, 1], ids=["not-a-multiple", "smaller-than-chunk", "multiple", "one"])
def test_chunked_loss_and_grads_equal_plain_cross_entropy(n):
    torch.manual_seed(n)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(n, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (n,))

    ours = chunked_head_cross_entropy(hidden, head, targets, chunk=CHUNK)
    ours_grads = torch.autograd.grad(ours, [hidden, head.weight])
    plain = F.cross_entropy(head(hidden), targets, reduction="sum")
    plain_grads = torch.autograd.grad(plain, [hidden, head.weight])

    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert abs(ours.item() - plain.item()) <= TOL * abs(plain.item()), (ours.item(), plain.item())
    assert_grads_close(ours_grads, plain_grads, ["hidden", "head.weight"])

    with torch.no_grad():  # the evaluation path (no checkpointing) gives the same sum
        assert abs(chunked_head_cross_entropy(hidden, head, targets, chunk=CHUNK).item() - plain.item()) <= TOL * abs(
            plain.item()
        )


def test_default_chunk_keeps_cpu_logits_under_the_mmap_threshold():
    from scaletune.models.loss import CPU_CHUNK_BYTES, default_chunk

    cpu = torch.device("cpu")
    rows = default_chunk(100_352, cpu)
    assert rows * 100_352 * 4 <= CPU_CHUNK_BYTES < 32 * 2**20 and rows == 62
    assert default_chunk(10**7, cpu) == 16  # never a degenerate matmul
    assert default_chunk(100_352, torch.device("cuda")) == 1024


def test_chunked_loss_with_the_default_chunk_equals_plain_cross_entropy():
    """OLMo-2's vocabulary, 150 targets: three chunks of 62 (the CPU default), the last one partial."""
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, 100_352, bias=False)
    hidden = torch.randn(150, HIDDEN, requires_grad=True)
    targets = torch.randint(0, 100_352, (150,))
    ours = chunked_head_cross_entropy(hidden, head, targets)
    plain = F.cross_entropy(head(hidden), targets, reduction="sum")
    assert abs(ours.item() - plain.item()) <= TOL * abs(plain.item())
    assert_grads_close(
        torch.autograd.grad(ours, [hidden, head.weight]),
        torch.autograd.grad(plain, [hidden, head.weight]),
        ["hidden", "head.weight"],
    )


def test_chunked_loss_of_no_targets_is_zero_and_backward_able():
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(0, HIDDEN, requires_grad=True)
    loss = chunked_head_cross_entropy(hidden, head, torch.zeros(0, dtype=torch.long), chunk=CHUNK)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and loss.item() == 0.0
    assert loss.requires_grad
    # The head is used even so (its hooks fire, DDP sees its weight used): its gradient is zero, not None.
    g_hidden, g_weight = torch.autograd.grad(loss, [hidden, head.weight])
    assert g_hidden.shape == (0, HIDDEN)
    assert g_weight.shape == head.weight.shape and torch.count_nonzero(g_weight) == 0


# ---------------------------------------------------------------------------------------------
# CausalLMLoss on tiny real models against `model(input_ids, labels=labels).loss`


def tiny_causal_lm(arch: str) -> nn.Module:
    """A 2-layer model of a real architecture with random weights, built from its config (fp32)."""
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    config = {"olmo2": transformers.Olmo2Config, "llama": transformers.LlamaConfig}[arch](**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model


def batch():
    """3 right-padded rows, a 4-token prompt masked with -100, padding masked too."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 256, (3, 12), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    attention_mask[2, -5:] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.clone()
    labels[:, :4] = IGNORE_INDEX
    labels[attention_mask == 0] = IGNORE_INDEX
    return input_ids, attention_mask, labels


def with_lora(model):
    from scaletune.config import LoraConfig
    from scaletune.models import apply_lora

    peft_model = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
    torch.manual_seed(2)
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters matter to the loss
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return peft_model


@pytest.mark.parametrize(
    "arch, lora", [("olmo2", False), ("llama", False), ("llama", True)], ids=["olmo2", "llama", "llama-lora"]
)
def test_causal_lm_loss_equals_the_models_own_loss(arch, lora):
    model = tiny_causal_lm(arch)
    if lora:
        model = with_lora(model)
    input_ids, attention_mask, labels = batch()
    n_targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert 0 < n_targets < labels[:, 1:].numel()  # the masking is really exercised
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    # chunk 5 < 19 targets: several chunks, the last one partial
    summed = CausalLMLoss(model, chunk=5)(input_ids, labels, target_index(labels), attention_mask)
    ours = summed / n_targets
    ours_grads = torch.autograd.grad(ours, params)
    hf = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    hf_grads = torch.autograd.grad(hf, params)

    assert abs(ours.item() - hf.item()) <= TOL * abs(hf.item()), (ours.item(), hf.item())
    assert_grads_close(ours_grads, hf_grads, names)
    if lora:
        assert any("lora_A" in n for n in names) and all("lora" in n for n in names)


def sdpa_calls(monkeypatch) -> list[tuple[bool, bool]]:
    """(an attention mask was passed, is_causal) of every SDPA call transformers makes from now on."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    calls, real = [], F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is not None, bool(is_causal)))
        return real(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(hf_sdpa.torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def packed_checks(monkeypatch) -> list[int]:
    """One entry per call of transformers' `find_packed_sequence_indices` from now on (the real
    function still runs): the per-forward check whose `.all()` is a host sync on a GPU."""
    import transformers.masking_utils as mu

    calls, real = [], mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda pos: calls.append(1) or real(pos))
    return calls


def test_right_padded_rows_run_causal_attention_without_a_mask(monkeypatch):
    """Issue 38: unpacked right-padded rows need no padding mask under causal attention (a real
    token never sees the padding after it), so the loss hands SDPA none and `is_causal` (the flash
    kernel), and transformers neither builds a mask nor checks for packed rows (its per-forward
    host sync). The loss and gradients are transformers' own with the mask
    (test_causal_lm_loss_equals_the_models_own_loss); here, what SDPA and the mask code were given."""
    model = tiny_causal_lm("llama")
    input_ids, attention_mask, labels = batch()
    calls, checks = sdpa_calls(monkeypatch), packed_checks(monkeypatch)
    CausalLMLoss(model)(input_ids, labels, target_index(labels), attention_mask, torch.arange(12).expand(3, 12))
    assert calls and set(calls) == {(False, True)}, calls
    assert checks == []
    assert model.config._attn_implementation == "sdpa"  # generation, after it, keeps its masks
    calls.clear()
    model(input_ids=input_ids, attention_mask=attention_mask)  # the control: transformers with the mask
    assert calls and set(calls) == {(True, False)}, calls
    model(input_ids=input_ids, use_cache=False)  # the control: no mask, sdpa: transformers checks for packed rows
    assert checks == [1]


def test_maskless_rows_recompute_the_same_attention_under_checkpointing():
    """Gradient checkpointing recomputes each layer in backward, outside the loss's forward (and its
    attention name): the loss and gradients equal those without checkpointing, which equal
    transformers' own with the mask."""
    reference, model = tiny_causal_lm("llama"), tiny_causal_lm("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    input_ids, attention_mask, labels = batch()
    names = [n for n, _ in model.named_parameters()]
    got, want = [], []
    for m, out in ((model, got), (reference, want)):
        loss = CausalLMLoss(m)(input_ids, labels, target_index(labels), attention_mask)
        out.append(loss.detach())
        out.extend(torch.autograd.grad(loss, list(m.parameters())))
    assert abs(got[0].item() - want[0].item()) <= TOL * abs(want[0].item())
    assert_grads_close(got[1:], want[1:], names)


def test_windowed_layers_keep_the_padding_mask(monkeypatch):
    """A model with sliding-window layers keeps the mask path (transformers builds their masks)."""
    import transformers

    config = transformers.MistralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    input_ids, attention_mask, labels = batch()
    calls = sdpa_calls(monkeypatch)
    n = int((labels[:, 1:] != IGNORE_INDEX).sum())
    ours = CausalLMLoss(model)(input_ids, labels, target_index(labels), attention_mask) / n
    assert calls and all(masked for masked, _ in calls), calls
    hf = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    assert abs(ours.item() - hf.item()) <= TOL * abs(hf.item())


def test_causal_lm_loss_with_no_targets_is_zero():
    model = tiny_causal_lm("llama")
    input_ids, attention_mask, labels = batch()
    labels[:] = IGNORE_INDEX
    loss = CausalLMLoss(model)(input_ids, labels, target_index(labels), attention_mask)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(model.lm_head.weight.grad) == 0


# ---------------------------------------------------------------------------------------------
# Activation offloading (save_on_cpu): identical numbers, and the decoder's tensors really go
# through its hooks


def loss_and_grads(module: CausalLMLoss, model: nn.Module):
    input_ids, attention_mask, labels = batch()
    loss = module(input_ids, labels, target_index(labels), attention_mask)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return loss, grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_activation_offload_gives_identical_loss_and_grads(checkpointing):
    from scaletune.models import enable_gradient_checkpointing

    model = tiny_causal_lm("olmo2")
    if checkpointing:
        enable_gradient_checkpointing(model)
        model.train()  # transformers checkpoints only in training mode
    loss, grads = loss_and_grads(CausalLMLoss(model, chunk=5), model)
    loss_off, grads_off = loss_and_grads(CausalLMLoss(model, chunk=5, activation_offload=True), model)
    assert torch.equal(loss, loss_off)
    for (name, _), g, g_off in zip(model.named_parameters(), grads, grads_off, strict=True):
        assert torch.equal(g, g_off), name


def test_activation_offload_takes_the_decoders_saved_tensors():
    """saved_tensors_hooks nest: the innermost pair handles a saved tensor. An outer counting pair
    therefore sees the decoder's saved tensors only when CausalLMLoss does not offload them."""
    model = tiny_causal_lm("llama")
    input_ids, attention_mask, labels = batch()

    def outer_count(activation_offload: bool) -> int:
        seen = []

        def pack(t):
            seen.append(t.shape)
            return t

        module = CausalLMLoss(model, chunk=5, activation_offload=activation_offload)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(input_ids, labels, target_index(labels), attention_mask).backward()
        return len(seen)

    kept, offloaded = outer_count(False), outer_count(True)
    assert offloaded < kept // 2, (offloaded, kept)  # what remains is the head's few saved inputs


# ---------------------------------------------------------------------------------------------
# Liger


def test_liger_loss_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(RuntimeError) as err:
        CausalLMLoss(tiny_causal_lm("llama"), liger=True)
    msg = str(err.value)
    assert "model.liger" in msg and "need a CUDA GPU" in msg and "model.liger: false" in msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel (pip install 'scaletune[liger]')"
)
def test_liger_loss_equals_chunked_loss_in_bf16():
    import transformers

    from scaletune.models import apply_liger_kernels

    config = transformers.LlamaConfig(
        vocab_size=32_000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 32_000, (4, 256), generator=g)
    labels = input_ids.clone()
    labels[:, :32] = IGNORE_INDEX
    labels[3, 200:] = IGNORE_INDEX
    idx = target_index(labels)
    input_ids, labels, idx = input_ids.cuda(), labels.cuda(), idx.cuda()

    chunked = CausalLMLoss(model)(input_ids, labels, idx)
    liger = CausalLMLoss(model, liger=True)(input_ids, labels, idx)
    assert abs(liger.item() - chunked.item()) <= 1e-3 * abs(chunked.item()), (liger.item(), chunked.item())
    liger.backward()
    assert torch.isfinite(model.lm_head.weight.grad).all() and model.lm_head.weight.grad.abs().sum() > 0

    # The model-level kernels (RMSNorm, RoPE, SwiGLU) rebind forwards in place; the loss stays close.
    patched = copy.deepcopy(model)
    assert apply_liger_kernels(patched) is True
    assert "forward" in vars(patched.model.norm) and "forward" in vars(patched.model.layers[0].mlp)
    with torch.no_grad():
        both = CausalLMLoss(patched, liger=True)(input_ids, labels, idx)
    assert abs(both.item() - chunked.item()) <= 1e-2 * abs(chunked.item()), (both.item(), chunked.item())

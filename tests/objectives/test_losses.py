"""The preference losses of :mod:`scaletune.objectives.losses` against TRL 1.16's own code, on random
per-sequence log-probabilities (several seeds and shapes, label smoothing 0 and 0.1, rel 1e-6).

The controls are TRL's real function bodies, called unbound on a minimal object that carries the
attributes they read (no copy of their formulas here):

- ORPO: ``ORPOTrainer.odds_ratio_loss``; SimPO: ``CPOTrainer.cpo_loss`` (``loss_type="simpo"``).
- DPO and IPO: TRL computes them inline in ``DPOTrainer._compute_loss``, which is called here on a
  batch whose model outputs are stubbed to hand it the chosen per-sequence log-probs (and the
  reference ones as precomputed columns); it returns the batch mean, so it is called one pair at a
  time. DPO with label smoothing: TRL 1.16's ``"sigmoid"`` no longer smooths, so the control is
  ``CPOTrainer.cpo_loss(loss_type="sigmoid")`` on the log-ratios (the same formula, cDPO).
- KTO: inline in ``KTOTrainer._compute_loss``, called the same way (precomputed reference and KL
  log-probs), one batch at a time, against the mean of ours with the KL TRL forms from the batch.

The end-to-end test (tests/e2e/test_preference_vs_trl.py) compares whole runs on a real model.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.cpo.cpo_trainer import CPOTrainer  # noqa: E402
from trl.experimental.orpo.orpo_trainer import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

from scaletune.objectives import losses  # noqa: E402

CASES = [(0, 1), (1, 7), (2, 33)]  # (seed, pairs)
REL = 1e-6


def _close(ours: torch.Tensor, trl: torch.Tensor, what: str) -> None:
    assert ours.dtype == torch.float32, f"{what}: {ours.dtype}"
    torch.testing.assert_close(ours, trl.float(), rtol=REL, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _draw(seed: int, m: int) -> dict[str, torch.Tensor]:
    """Summed log-probs of m pairs and their token counts: policy and reference near each other (the
    log-ratios a few nats), lengths 1..60."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 61, (2, m), generator=g)
    ref = -tokens * (0.5 + 3 * torch.rand(2, m, generator=g))
    policy = ref + 4 * torch.randn(2, m, generator=g)
    policy = torch.minimum(policy, torch.full_like(policy, -1e-3))  # a probability below 1
    return {
        "pc": policy[0],
        "pr": policy[1],
        "rc": ref[0],
        "rr": ref[1],
        "nc": tokens[0],
        "nr": tokens[1],
    }


def _accelerator() -> SimpleNamespace:
    identity = lambda t: t  # noqa: E731 -- one process: gathering is the identity
    return SimpleNamespace(device=torch.device("cpu"), gather=identity, gather_for_metrics=identity)


def _cpo(beta: float, loss_type: str, label_smoothing: float = 0.0, gamma: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(
        beta=beta,
        alpha=0.0,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        simpo_gamma=gamma,
        accelerator=_accelerator(),
    )


def _outputs(per_seq: torch.Tensor, width: int) -> SimpleNamespace:
    """What TRL's fused LM head returns, for rows whose per-token log-probs sum to `per_seq`: the sum
    on the first predicted position, zeros elsewhere (TRL only sums them)."""
    log_probs = torch.zeros(per_seq.numel(), width - 1)
    log_probs[:, 0] = per_seq
    zeros = torch.zeros_like(log_probs)
    return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def _trainer_stub(**attrs) -> SimpleNamespace:
    return SimpleNamespace(
        accelerator=_accelerator(),
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(gradient_checkpointing_kwargs=None, max_length=None),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        **attrs,
    )


def _trl_dpo(pc, pr, rc, rr, nc, nr, *, beta: float, loss_type: str) -> torch.Tensor:
    """TRL's DPOTrainer._compute_loss on one pair: the policy's summed log-probs through the stubbed
    model, the reference's as precomputed columns, the completion lengths through completion_mask."""
    width = int(max(nc, nr)) + 2
    completion_mask = torch.zeros(2, width, dtype=torch.long)
    completion_mask[0, 1 : 1 + int(nc)] = 1
    completion_mask[1, 1 : 1 + int(nr)] = 1
    inputs = {
        "input_ids": torch.ones(2, width, dtype=torch.long),
        "attention_mask": torch.ones(2, width, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": rc.reshape(1),
        "ref_rejected_logps": rr.reshape(1),
    }
    stub = _trainer_stub(
        beta=beta,
        label_smoothing=0.0,
        loss_types=[loss_type],
        loss_weights=[1.0],
        f_divergence_type="reverse_kl",
        ld_alpha=None,
        use_weighting=False,
    )
    model = lambda **kw: _outputs(torch.stack([pc, pr]), width)  # noqa: E731
    return DPOTrainer._compute_loss(stub, model, inputs, False)


@pytest.mark.parametrize("seed,m", CASES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_equals_trl_sigmoid(seed, m, beta):
    d = _draw(seed, m)
    ours = losses.dpo(d["pc"], d["pr"], d["rc"], d["rr"], beta=beta)
    assert ours.shape == (m,)
    trl = torch.stack([_trl_dpo(*(d[k][i] for k in d), beta=beta, loss_type="sigmoid") for i in range(m)])
    _close(ours, trl, "dpo vs DPOTrainer._compute_loss(sigmoid)")


@pytest.mark.parametrize("seed,m", CASES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_label_smoothing_equals_trl_cpo_sigmoid(seed, m, label_smoothing):
    # TRL 1.16's DPO "sigmoid" ignores label_smoothing; CPO's "sigmoid" applies it to whatever log-probs
    # it is given: given the log-ratios it is conservative DPO.
    d = _draw(seed, m)
    ours = losses.dpo(d["pc"], d["pr"], d["rc"], d["rr"], beta=0.2, label_smoothing=label_smoothing)
    trl, _, _ = CPOTrainer.cpo_loss(_cpo(0.2, "sigmoid", label_smoothing), d["pc"] - d["rc"], d["pr"] - d["rr"])
    _close(ours, trl, f"dpo(ls={label_smoothing}) vs CPOTrainer.cpo_loss(sigmoid)")


@pytest.mark.parametrize("seed,m", CASES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_equals_trl(seed, m, beta):
    d = _draw(seed, m)
    ours = losses.ipo(d["pc"], d["pr"], d["rc"], d["rr"], d["nc"], d["nr"], beta=beta)
    assert ours.shape == (m,)
    trl = torch.stack([_trl_dpo(*(d[k][i] for k in d), beta=beta, loss_type="ipo") for i in range(m)])
    _close(ours, trl, "ipo vs DPOTrainer._compute_loss(ipo)")


@pytest.mark.parametrize("seed,m", CASES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (10.0, 1.4)])
def test_simpo_equals_trl_cpo(seed, m, label_smoothing, beta, gamma):
    d = _draw(seed, m)
    ours = losses.simpo(d["pc"], d["pr"], d["nc"], d["nr"], beta=beta, gamma=gamma, label_smoothing=label_smoothing)
    assert ours.shape == (m,)
    # CPO's concatenated_forward hands cpo_loss the AVERAGE log-probs for loss_type simpo.
    stub = _cpo(beta, "simpo", label_smoothing, gamma)
    trl, _, _ = CPOTrainer.cpo_loss(stub, d["pc"] / d["nc"], d["pr"] / d["nr"])
    _close(ours, trl, "simpo vs CPOTrainer.cpo_loss(simpo)")


@pytest.mark.parametrize("seed,m", CASES)
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_odds_ratio_equals_trl(seed, m, beta):
    d = _draw(seed, m)
    # Averages near 0 as well (short, likely answers), where log(1 - exp(a)) needs the stable branch.
    pc = torch.cat([d["pc"], torch.tensor([-1e-4, -0.3])])
    pr = torch.cat([d["pr"], torch.tensor([-2.0, -1e-5])])
    nc, nr = torch.cat([d["nc"], torch.tensor([1, 1])]), torch.cat([d["nr"], torch.tensor([1, 1])])
    ours = losses.orpo_odds_ratio(pc, pr, nc, nr, beta=beta)
    stub = SimpleNamespace(beta=beta, accelerator=_accelerator())
    trl_terms, *_ = ORPOTrainer.odds_ratio_loss(stub, pc / nc, pr / nr)
    # TRL returns beta * logsigmoid(log_odds) and subtracts it: the added term is its negation.
    _close(ours, -trl_terms, "orpo_odds_ratio vs -ORPOTrainer.odds_ratio_loss")


def _trl_kto(policy, reference, kl_policy, kl_reference, desirable, *, beta, dw, uw) -> torch.Tensor:
    """TRL's KTOTrainer._compute_loss on one batch (stubbed model outputs, precomputed reference and
    KL reference log-probs): the mean of its per-example losses."""
    n, width = policy.numel(), 4
    ids = torch.arange(n)[:, None].expand(n, width).contiguous()
    completion_mask = torch.zeros(n, width, dtype=torch.long)
    completion_mask[:, 2:] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(n, width, dtype=torch.long),
        "completion_mask": completion_mask,
        "KL_input_ids": ids + 1000,  # the stubbed model tells the KL forward apart by its ids
        "KL_attention_mask": torch.ones(n, width, dtype=torch.long),
        "KL_completion_mask": completion_mask,
        "label": desirable,
        "ref_logps": reference,
        "ref_KL_logps": kl_reference,
    }

    def model(input_ids, **_):
        return _outputs(kl_policy if int(input_ids[0, 0]) >= 1000 else policy, width)

    stub = _trainer_stub(beta=beta, desirable_weight=dw, undesirable_weight=uw, loss_type="kto", calculate_KL=True)
    # TRL's own KL pass, bound to the stub.
    stub._compute_kl_logps = lambda model, batch: KTOTrainer._compute_kl_logps(stub, model, batch)
    return KTOTrainer._compute_loss(stub, model, batch, False)


@pytest.mark.parametrize("seed,n", [(0, 2), (1, 7), (2, 32)])
@pytest.mark.parametrize("dw,uw", [(1.0, 1.0), (1.33, 0.7)])
def test_kto_equals_trl(seed, n, dw, uw):
    g = torch.Generator().manual_seed(100 + seed)
    reference = -60 * torch.rand(n, generator=g)
    policy = reference + 5 * torch.randn(n, generator=g)
    kl_reference = -60 * torch.rand(n, generator=g)
    # Shifted up on one seed so the KL estimate is positive there, down on another (clamped to 0).
    kl_policy = kl_reference + torch.randn(n, generator=g) + (seed - 1) * 2.0
    desirable = torch.arange(n) % 3 != 1
    kl = (kl_policy - kl_reference).mean().clamp(min=0).detach()
    ours = losses.kto(policy, reference, desirable, kl, beta=0.3, desirable_weight=dw, undesirable_weight=uw)
    assert ours.shape == (n,)
    trl = _trl_kto(policy, reference, kl_policy, kl_reference, desirable, beta=0.3, dw=dw, uw=uw)
    _close(ours.mean(), trl, "kto (mean) vs KTOTrainer._compute_loss")


# Properties (not against TRL): each can fail on a wrong formula.


def test_dpo_at_zero_margin_is_log_2_with_or_without_smoothing():
    zero = torch.zeros(3)
    for ls in (0.0, 0.1, 0.3):
        loss = losses.dpo(zero - 5, zero - 7, zero - 5, zero - 7, beta=0.1, label_smoothing=ls)
        torch.testing.assert_close(loss, torch.full((3,), math.log(2)), rtol=1e-7, atol=0)


def test_ipo_minimum_at_per_token_margin_half_over_beta():
    beta, nc, nr = 0.25, torch.tensor([4.0]), torch.tensor([10.0])
    # Per-token chosen log-ratio 2 = 1 / (2 * beta) above the rejected one (0): loss 0, and larger on either side.
    at = losses.ipo(
        torch.tensor([-10.0 + 8]),
        torch.tensor([-30.0]),
        torch.tensor([-10.0]),
        torch.tensor([-30.0]),
        nc,
        nr,
        beta=beta,
    )
    assert float(at) == 0.0
    for shift in (-0.5, 0.5):
        off = losses.ipo(
            torch.tensor([-2.0 + shift * 4]),
            torch.tensor([-30.0]),
            torch.tensor([-10.0]),
            torch.tensor([-30.0]),
            nc,
            nr,
            beta=beta,
        )
        assert float(off) == pytest.approx(shift**2, rel=1e-6)


def test_kto_at_the_reference_point_is_half_its_weight():
    r = torch.tensor([-3.0, -3.0])
    loss = losses.kto(
        r + 0.2,
        r,
        torch.tensor([True, False]),
        torch.tensor(0.2),
        beta=0.5,
        desirable_weight=2.0,
        undesirable_weight=0.5,
    )
    torch.testing.assert_close(loss, torch.tensor([1.0, 0.25]), rtol=1e-7, atol=0)


def test_float32_from_bfloat16_inputs():
    d = _draw(3, 5)
    bf = {k: v.to(torch.bfloat16) for k, v in d.items()}
    out = losses.dpo(bf["pc"], bf["pr"], bf["rc"], bf["rr"], beta=0.1)
    assert out.dtype == torch.float32
    assert losses.simpo(bf["pc"], bf["pr"], d["nc"], d["nr"], beta=2.0, gamma=0.5).dtype == torch.float32

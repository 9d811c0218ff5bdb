"""Issue 36's distillation done-when: the loss of `objectives.distill.Distill`, through the loss module
every run wraps (`objectives.module.PreferenceLoss`, the teacher held in the engines'
`FrozenReference`), equals TRL 1.16's `GKDTrainer.generalized_jsd_loss` on the two models' whole
logits within 1e-6 for forward KL (TRL's beta 0), reverse KL (beta 1) and the generalized JSD (beta
0.5 and 0.3), at temperature 1 and 2; the student's gradients equal those of TRL's loss.

The models: two tiny random Llamas of one vocabulary (the teacher deeper and wider), float32. The
batch: two rows, the first tokens of each a prompt (label -100), the second row right-padded
(attention_mask 0, label -100), as the SFT collator makes them. TRL's loss gets the logits that
predict each label (position t predicts label t + 1) with the shifted labels, as its `compute_loss`
slices them; its "batchmean" divides by the trained tokens, as the step does for one micro-batch.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

VOCAB = 96


def _llama(seed: int, hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float().eval()


def _batch():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding
    labels = ids.clone()
    labels[:, :3] = -100  # the prompt
    labels[mask == 0] = -100
    return ids, mask, labels


@pytest.fixture(scope="module")
def models():
    return _llama(0, 32, 2), _llama(1, 48, 3)


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5), ("jsd", 0.3)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distill_loss_and_gradients_equal_trls_generalized_jsd(models, loss, beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    from scaletune.config.distill import DistillConfig
    from scaletune.models.loss import target_index
    from scaletune.objectives.distill import Distill
    from scaletune.objectives.module import PreferenceLoss
    from scaletune.strategies.frozen_reference import freeze

    student, teacher = models
    ids, mask, labels = _batch()
    settings = DistillConfig(
        teacher="t", loss=loss, temperature=temperature, **({"beta": beta} if loss == "jsd" else {})
    )
    assert settings.mixture_beta == beta

    # TRL on the whole logits, as GKDTrainer.compute_loss slices them.
    control = copy.deepcopy(student)
    s_logits = control(input_ids=ids, attention_mask=mask).logits[:, :-1]
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1]
    want = GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels[:, 1:], beta=beta, temperature=temperature)
    want.backward()

    mine = copy.deepcopy(student)
    module = PreferenceLoss(mine, chunk=4)  # 4 target rows a chunk: several chunks
    module.start_stage(Distill(settings))
    module.set_reference(freeze(copy.deepcopy(teacher)))
    components = module(ids, labels, target_index(labels), mask, None)
    targets = int((labels[:, 1:] != -100).sum())
    got = components[0] / targets
    got.backward()

    assert abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want))), (float(got), float(want))
    for (name, a), (_, b) in zip(mine.named_parameters(), control.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
    # The table of facts: one unit, the target tokens; the metric keys; a frozen model read.
    from scaletune.config.preference import OBJECTIVES as FACTS

    facts, objective = FACTS["distill"], module.objective
    assert facts.units == ("target tokens",) and objective.units({"labels": labels}) == (targets,)
    assert facts.reference and objective.uses_reference and settings.reference == "model"
    # The stats: the divergence sum again, the NLLs, the target tokens.
    stats = module.last_stats.tolist()
    assert set(objective.metrics(stats)) == set(facts.metrics)
    assert stats[3] == targets and stats[0] == pytest.approx(float(components[0]), rel=1e-6)
    shifted = labels[:, 1:]
    keep = shifted != -100
    t_nll = torch.nn.functional.cross_entropy((t_logits / temperature)[keep], shifted[keep], reduction="sum")
    s_nll = torch.nn.functional.cross_entropy((s_logits.detach() / temperature)[keep], shifted[keep], reduction="sum")
    assert stats[2] == pytest.approx(float(t_nll), rel=1e-5) and stats[1] == pytest.approx(float(s_nll), rel=1e-5)

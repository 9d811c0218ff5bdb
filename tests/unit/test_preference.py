"""Preference data and log-probs (issue 24), each against an independent control: pairs render as the
tokenizer's own chat template renders them with only the completion trained; KTO's KL rows pair each
prompt with the previous record's completion (as TRL); the collator lays out [chosen; rejected]; per-sequence
log-probs equal a log-softmax over the model's full logits; the DPO module's loss equals the paper's
formula on those; a stage's own preference section."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import ALPACA_5000, OLMO2_TOKENIZER, make_config

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from scaletune.models import tokenizer_from_file

    tok = tokenizer_from_file(OLMO2_TOKENIZER, model_max_length=512)
    tok.chat_template = CHATML
    return tok


def _build(tmp_path, tokenizer, records, fmt="preference", max_len=128):
    from scaletune.config import DataConfig
    from scaletune.data import build_datasets

    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    cfg = DataConfig.model_validate({"train": {"path": str(path), "format": fmt}, "max_seq_length": max_len})
    return build_datasets(cfg, tokenizer, seed=0, cache_dir=tmp_path / "cache")


def _trained(ids, labels):
    return [t for t, lab in zip(ids, labels) if lab != -100]


def test_pairs_render_through_the_template_and_train_only_the_completion(tmp_path, tokenizer):
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    records = [
        {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"},
        {"prompt": conv, "chosen": [{"role": "assistant", "content": "Red."}], "rejected": "Seven."},
    ]
    rows = _build(tmp_path, tokenizer, records).train
    for row, rec in zip(rows, records):
        prompt = [{"role": "user", "content": rec["prompt"]}] if isinstance(rec["prompt"], str) else rec["prompt"]
        for side in ("chosen", "rejected"):
            answer = rec[side] if isinstance(rec[side], str) else rec[side][0]["content"]
            # The control: transformers' own rendering of the whole conversation, tokenized whole.
            text = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=False)
            assert row[f"{side}_input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
            # Trained: the answer and its end of turn, nothing of the prompt (not its own assistant turn).
            trained = tokenizer.decode(_trained(row[f"{side}_input_ids"], row[f"{side}_labels"]))
            assert trained == answer + "<|im_end|>"


def test_pairs_without_a_trained_token_are_dropped_and_kto_pairs_the_previous_completion(tmp_path, tokenizer):
    long = "word " * 400
    records = [
        {"prompt": "a", "chosen": "yes", "rejected": "no"},
        {"prompt": long, "chosen": "yes", "rejected": "no"},  # the answers are cut away at 64 tokens
    ]
    bundle = _build(tmp_path, tokenizer, records, max_len=64)
    assert len(bundle.train) == 1 and bundle.stats["dropped_empty"] == 1 and bundle.train[0]["index"] == 0

    alpaca = json.loads(ALPACA_5000.read_text())[:3]
    kto = [{"prompt": r["instruction"], "completion": r["output"], "label": i != 1} for i, r in enumerate(alpaca)]
    rows = _build(tmp_path, tokenizer, kto, fmt="kto", max_len=512).train
    assert [r["desirable"] for r in rows] == [True, False, True]
    for i, row in enumerate(rows):
        kl_answer = tokenizer.decode(_trained(row["kl_input_ids"], row["kl_labels"]))
        assert kl_answer == alpaca[(i - 1) % 3]["output"] + "<|im_end|>"
        assert alpaca[i]["instruction"] in tokenizer.decode(row["kl_input_ids"])


def test_collator_puts_chosen_rows_before_rejected_rows(tmp_path, tokenizer):
    from scaletune.data.preference import PreferenceCollator
    from scaletune.objectives.precomputed import attach_reference

    records = [{"prompt": f"q{i}", "chosen": f"good answer {i}", "rejected": f"bad {i}"} for i in range(3)]
    ds = _build(tmp_path, tokenizer, records).train
    ds = attach_reference(ds, torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]), "preference")
    batch = PreferenceCollator(tokenizer.pad_token_id, "preference")([ds[2], ds[0]])
    assert batch["input_ids"].shape[0] == 4 and batch["index"].tolist() == [2, 0]
    assert batch["ref_logps"].tolist() == [-5.0, -1.0, -6.0, -2.0]
    for i, (row, side) in enumerate([(ds[2], "chosen"), (ds[0], "chosen"), (ds[2], "rejected"), (ds[0], "rejected")]):
        n = len(row[f"{side}_input_ids"])
        assert batch["input_ids"][i, :n].tolist() == row[f"{side}_input_ids"]
        assert batch["attention_mask"][i].sum() == n and (batch["labels"][i, n:] == -100).all()


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _control_logps(model, input_ids, labels, attention_mask):
    """log p of each row's labelled tokens from the full logits (the textbook computation)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    picked = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 6:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :4] = -100  # the prompt
    return ids, labels, mask


def test_sequence_logps_equal_a_log_softmax_of_the_full_logits(llama):
    from scaletune.objectives.logprobs import sequence_logps

    ids, labels, mask = _batch(llama.config.vocab_size)
    want, tokens = _control_logps(llama, ids, labels, mask)
    for chunk in (3, None):  # several head chunks, and the default
        got, got_tokens = sequence_logps(llama, ids, labels, mask, mask.cumsum(-1) - 1, chunk=chunk)
        assert got_tokens.tolist() == tokens.tolist()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)


def test_dpo_module_loss_is_the_papers_formula_on_the_models_log_probs(llama):
    import torch.nn.functional as F

    from scaletune.config.preference import PreferenceConfig
    from scaletune.objectives.module import PreferenceLoss
    from scaletune.objectives.table import objective_for

    ids, labels, mask = _batch(llama.config.vocab_size)
    ref = torch.tensor([-30.0, -31.0, -29.0, -35.0])
    module = PreferenceLoss(llama)
    module.start_stage(objective_for("dpo", PreferenceConfig(beta=0.2, reference="precomputed")))
    out = module(ids, labels, attention_mask=mask, position_ids=mask.cumsum(-1) - 1, ref_logps=ref)
    logp, _ = _control_logps(llama, ids, labels, mask)
    margin = (logp[:2] - ref[:2]) - (logp[2:] - ref[2:])
    assert out.shape == (1,)
    assert torch.allclose(out[0], -F.logsigmoid(0.2 * margin).sum(), rtol=1e-5)
    stats = module.last_stats.tolist()
    assert (
        stats[0] == 2
        and stats[1] == float((margin > 0).sum())
        and stats[2] == pytest.approx(0.2 * float(margin.sum()), rel=1e-5)
    )


def test_a_stage_sets_its_own_preference_section(tmp_path, tiny_model_dir):
    """`stages[].training.preference` replaces the top level's section, decided like it (auto ->
    base under LoRA): SFT, then DPO with its own beta, then IPO with the top level's."""
    from scaletune.config import load_config
    from scaletune.resolve import resolve_stages

    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        model={"lora": {"r": 4}},
        training={"preference": {"beta": 0.3}},
        stages=[
            {"name": "sft"},
            {"name": "dpo", "training": {"objective": "dpo", "preference": {"beta": 0.05, "reference": "model"}}},
            {"name": "ipo", "training": {"objective": "ipo"}},
        ],
    )
    stages = resolve_stages(load_config(None, data=cfg))
    prefs = [(s.training.objective, s.training.preference.beta, s.training.preference.reference) for s in stages]
    assert prefs == [("sft", 0.3, "base"), ("dpo", 0.05, "model"), ("ipo", 0.3, "base")]


def test_inference_prompts_a_preference_run_through_the_chat_template():
    """Sample prompts, `chat` and `generate` prompt a preference or KTO run as its data was rendered
    (through the chat template, as `data.build` renders every pair); an alpaca run stays alpaca."""
    from scaletune.config import DataConfig
    from scaletune.inference.loading import trained_template

    for fmt, want in (("preference", "chat"), ("kto", "chat"), ("alpaca", "alpaca"), ("text", "none")):
        data = DataConfig.model_validate({"train": {"path": "x.jsonl", "format": fmt}})
        assert trained_template(data, tokenizer=None) == want, fmt

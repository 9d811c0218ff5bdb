"""Issue 24's first done-when: on the same model and pairs, the first-step DPO, IPO, KTO, ORPO and SimPO
losses of `scaletune train` equal TRL 1.16's implementation within 1e-5 in float32.

Each objective: a tiny random OLMo-2 model (float32), N = 4 real pairs (Alpaca records: prompt = the
instruction and input, chosen = the record's output, rejected = the next record's output; KTO: record
i's own output, desirable, for even i and the next record's, undesirable, for odd i), written as jsonl.
`scaletune train` runs them in one process with `global_batch_size: 4`, `micro_batch_size: 2` (so
accumulation is exercised); its step-1 `loss` (and metrics) are read from metrics.jsonl. TRL's trainer
is then built on the SAME weights and records with `per_device_train_batch_size: 4`, one batch of the
whole set is taken from its own data loader, and `trainer.compute_loss(model, batch)` is the control.

The sequences are asserted identical first: the token ids and trained-token masks TRL builds equal the
rows scaletune's data pipeline builds. To make them so:

- Chat template. Both render through the tokenizer's template. ChatML ends every turn with
  ``<|im_end|>\\n``; scaletune trains the content and ``<|im_end|>`` and not the newline after it (it is
  not the model's to produce), TRL's conversational DPO/KTO train everything after the prompt, newline
  included: one end token differs. The model here carries a ChatML variant that writes the newline
  BEFORE each turn after the first (and before the generation prompt), so a conversation ends on
  ``<|im_end|>`` and both sides train exactly the content and ``<|im_end|>``.
- ORPO and SimPO (TRL's CPO) take strings and add the tokenizer's BOS before the prompt and its EOS
  after the answer (the OLMo-2 tokenizer's ``<|endoftext|>``, which no chat template writes). They are
  given the rendered prompt and answer text and a copy of the tokenizer with no BOS and ``<|im_end|>``
  as EOS, so they add neither.

Reference objectives (DPO, IPO, KTO) use `reference: precomputed`: the reference is the initial model
(TRL: `ref_model` the initial model). At step 1 the policy IS the reference, so every log-ratio is 0
and DPO's loss is log 2 whatever the log-probs: step 1 is compared (loss and the logp metrics, which
do depend on the model), and so is step 2, where the policy is the model after step 1 (exported from
scaletune's step-1 checkpoint, the reference still the initial model) and the log-ratios are not 0.

KTO's KL term: scaletune pairs record i's prompt with record (i - 1) mod N's completion (file order),
and its kl is the mean over the global batch of (policy - reference) KL log-probs, clamped at 0 and
detached. TRL's `KTOTrainer` rotates completions within each block of `per_device_train_batch_size`
records: `KL_completion_ids = [y_N-1, y_0, ..., y_N-2]`, the same pairs when the whole set is one
batch (`test_kto_kl_pairs_equal_trl`), then takes the same clamped mean. (scaletune first paired
i with i + 1; this test found it: KL 0.841 vs 0.743 at step 2, the loss 8.3e-4 apart.)

The five `scaletune train` runs are started together in a module fixture, two at a time.

ORPO's NLL: TRL's `ORPOTrainer` takes the chosen NLL over the prompt AND the answer ("orpo chosen
nll loss is computed over the full prompt and response"); scaletune over the answer's trained tokens
only, as for SFT. The control of ORPO is therefore assembled from TRL's own numbers: the token-mean
NLL of the chosen answers as TRL's `CPOTrainer` computes it (`nll_loss`, prompt masked) plus ORPO's
odds-ratio term as `ORPOTrainer.compute_loss` logs it (`-beta * log_odds_ratio`); TRL's whole ORPO
loss is reported beside it and differs by exactly the prompt tokens' share of the NLL.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import ALPACA_5000, make_config, metrics, train

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

N = 4
REL = 1e-5
BETA = 0.1
# ChatML with the newline between turns written before a turn rather than after it: a conversation
# then ends on <|im_end|> (see the module docstring).
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\\n<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _short_records() -> list[dict]:
    """The first N + 1 Alpaca records with a short prompt and answer, answers all different."""
    records = json.loads(Path(ALPACA_5000).read_text())
    out: list[dict] = []
    for r in records:
        prompt = f"{r['instruction']}\n\n{r['input']}" if r.get("input") else r["instruction"]
        if len(prompt) <= 100 and 20 <= len(r["output"]) <= 100 and r["output"] not in {o["a"] for o in out}:
            out.append({"q": prompt, "a": r["output"]})
        if len(out) == N + 1:
            return out
    raise AssertionError("not enough short Alpaca records")


def _pairs() -> list[dict]:
    r = _short_records()
    return [{"prompt": r[i]["q"], "chosen": r[i]["a"], "rejected": r[i + 1]["a"]} for i in range(N)]


def _kto_records() -> list[dict]:
    r = _short_records()
    return [
        {"prompt": r[i]["q"], "completion": r[i]["a"] if i % 2 == 0 else r[i + 1]["a"], "label": i % 2 == 0}
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The session's tiny OLMo-2 model with the chat template above saved in its tokenizer."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("pref") / "olmo2-tiny-chat"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(
    model_dir: Path, tmp_path: Path, objective: str, steps: int, beta: float = BETA, **preference
) -> tuple[dict, Path]:
    """`scaletune train` of `objective` on the pairs (KTO: its records): (its config dict, run dir)."""
    fmt = "kto" if objective == "kto" else "preference"
    data = _write(tmp_path / f"{fmt}.jsonl", _kto_records() if fmt == "kto" else _pairs())
    out = tmp_path / f"run-{objective}"
    cfg = make_config(
        model_dir,
        out,
        data={"train": {"path": str(data), "format": fmt}, "max_seq_length": 256},
        training={
            "objective": objective,
            "preference": {"beta": beta, **preference},
            "global_batch_size": N,
            "micro_batch_size": N // 2,
            "max_steps": steps,
            "save_every": 1,
            "warmup_steps": 0,
            "lr_scheduler": "constant",
            "learning_rate": 1e-2,
        },
    )
    # Its own cache (tokenised data, the precomputed reference table): the runs start together, and
    # nothing is read from an earlier session's.
    train(cfg, tmp_path, name=f"{objective}.yaml", timeout=300, env={"SCALETUNE_CACHE": str(tmp_path / "cache")})
    return cfg, out


def _our_rows(cfg: dict, tmp_path: Path) -> list[dict]:
    """The rows scaletune's data pipeline builds for the run's config (its own build_datasets)."""
    from transformers import AutoTokenizer

    from scaletune.config import load_config
    from scaletune.data import build_datasets

    config = load_config(None, data=cfg)
    tok = AutoTokenizer.from_pretrained(cfg["model"]["name_or_path"])
    bundle = build_datasets(config.data, tok, seed=config.seed, cache_dir=tmp_path / "ds-cache")
    return [dict(r) for r in bundle.train]


def _seq(ids, mask) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    return tuple(int(i) for i in ids), tuple(bool(m) for m in mask)


def _trl_rows(ids, attention, trained) -> list[tuple]:
    """TRL's padded rows, unpadded: (ids, trained mask) per row."""
    return [_seq(i[a.bool()], t[a.bool()]) for i, a, t in zip(ids, attention, trained)]


def _ours(rows: list[dict], side: str) -> list[tuple]:
    return [_seq(r[f"{side}input_ids"], [x != -100 for x in r[f"{side}labels"]]) for r in rows]


def _model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _tokenizer(model_dir: Path, *, plain_strings: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if plain_strings:  # ORPO/CPO: no BOS before the prompt, <|im_end|> already ends the answer
        tok.bos_token = None
        tok.eos_token = "<|im_end|>"
    return tok


def _conversational(rows: list[dict]) -> list[dict]:
    def turn(role, text):
        return [{"role": role, "content": text}]

    out = []
    for r in rows:
        conv = {"prompt": turn("user", r["prompt"])}
        for k in ("chosen", "rejected", "completion"):
            if k in r:
                conv[k] = turn("assistant", r[k])
        if "label" in r:
            conv["label"] = r["label"]
        out.append(conv)
    return out


def _rendered(rows: list[dict], tok) -> list[dict]:
    """Pairs as the strings ORPO/CPO tokenize: the rendered prompt (generation prompt included) and
    each rendered answer (what the whole conversation adds after it)."""
    out = []
    for r in rows:
        user = [{"role": "user", "content": r["prompt"]}]
        prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        row = {"prompt": prompt}
        for k in ("chosen", "rejected"):
            full = tok.apply_chat_template([*user, {"role": "assistant", "content": r[k]}], tokenize=False)
            assert full.startswith(prompt)
            row[k] = full[len(prompt) :]
        out.append(row)
    return out


def _trl_args(config_cls, tmp_path: Path, beta: float = BETA, **kw):
    return config_cls(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=N,
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=beta,
        **kw,
    )


def _trl_batch(trainer) -> dict:
    """One batch of the whole set from TRL's own loader; the model in training mode (TRL logs its
    metrics under "train" then; dropout is off: TRL's disable_dropout, and the model has none)."""
    trainer.model.train()
    return next(iter(trainer.get_train_dataloader()))


def _step(run_dir: Path, step: int) -> dict:
    return next(m for m in metrics(run_dir) if m.get("step") == step and "loss" in m)


def _export(run_dir: Path, step: int, tmp_path: Path) -> Path:
    """The model after `step` as a Hugging Face folder, from scaletune's checkpoint (in process)."""
    from scaletune.checkpoint.export import export_checkpoint

    return export_checkpoint(run_dir / "checkpoints" / f"step-{step}", tmp_path / f"step-{step}-hf")


def _close(ours: float, trl: float, what: str, rel: float = REL, atol: float = 0.0) -> None:
    assert math.isfinite(ours) and math.isfinite(trl), f"{what}: {ours} vs {trl}"
    assert abs(ours - trl) <= rel * abs(trl) + atol, (
        f"{what}: scaletune {ours!r} vs TRL {trl!r} (rel {abs(ours - trl) / abs(trl):.2e})"
    )


def _dpo_trainer(model_dir: Path, policy: Path, tmp_path: Path, loss_type: str):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = _trl_args(DPOConfig, tmp_path, loss_type=[loss_type], max_length=None)
    return DPOTrainer(
        model=_model(policy),
        ref_model=_model(model_dir),
        args=args,
        train_dataset=Dataset.from_list(_conversational(_pairs())),
        processing_class=_tokenizer(model_dir),
    )


SIMPO = {"beta": 2.0, "gamma": 0.5, "label_smoothing": 0.1}
KTO_WEIGHTS = {"desirable_weight": 1.0, "undesirable_weight": 1.3}
#: Each objective's `scaletune train` run: the reference objectives for 2 steps (see the docstring).
RUNS = {
    "dpo": {"steps": 2, "reference": "precomputed"},
    "ipo": {"steps": 2, "reference": "precomputed"},
    "kto": {"steps": 2, "reference": "precomputed", **KTO_WEIGHTS},
    "simpo": {"steps": 1, **SIMPO},
    "orpo": {"steps": 1},
}


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict[str, tuple[dict, Path, Path]]:
    """The five runs, two at a time (each is one process, mostly Python start-up and tokenizing):
    objective -> (its config, its run directory, its temporary folder)."""
    from concurrent.futures import ThreadPoolExecutor

    tmps = {o: tmp_path_factory.mktemp(o) for o in RUNS}
    with ThreadPoolExecutor(2) as pool:
        futures = {o: pool.submit(_run, model_dir, tmps[o], o, **kw) for o, kw in RUNS.items()}
        return {o: (*f.result(), tmps[o]) for o, f in futures.items()}


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_dpo_ipo_equal_trl(objective, runs, model_dir):
    """Step 1 (policy = reference) and step 2 (policy after one step) of `scaletune train` against
    `DPOTrainer.compute_loss` (loss_type sigmoid, ipo) on the same weights and pairs."""
    import torch

    cfg, run, tmp_path = runs[objective]
    rows = _our_rows(cfg, tmp_path)
    for step, policy in ((1, model_dir), (2, _export(run, 1, tmp_path))):
        trainer = _dpo_trainer(
            model_dir, policy, tmp_path / f"trl-{step}", objective if objective == "ipo" else "sigmoid"
        )
        batch = _trl_batch(trainer)
        rows_trl = _trl_rows(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        trl_pairs = sorted(zip(rows_trl[:N], rows_trl[N:]))
        assert trl_pairs == sorted(zip(_ours(rows, "chosen_"), _ours(rows, "rejected_"))), "token ids / trained masks"
        with torch.no_grad():
            trl_loss = float(trainer.compute_loss(trainer.model, batch))
        logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        ours = _step(run, step)
        print(f"{objective} step {step}: scaletune {ours['loss']!r} TRL {trl_loss!r}")
        _close(ours["loss"], trl_loss, f"{objective} step {step} loss")
        _close(ours["logp_chosen"], logged["logps/chosen"], f"{objective} step {step} logp_chosen")
        _close(ours["logp_rejected"], logged["logps/rejected"], f"{objective} step {step} logp_rejected")
        assert ours["reward_accuracy"] == pytest.approx(logged["rewards/accuracies"], abs=1e-9), f"step {step}"
        if step == 1:
            _close(ours["loss"], math.log(2) if objective == "dpo" else (1 / (2 * BETA)) ** 2, "policy = reference")
        else:
            _close(ours["reward_margin"], logged["rewards/margins"], f"{objective} step 2 reward_margin", rel=1e-4)
            assert abs(logged["rewards/margins"]) > 1e-3, "step 2's log-ratios are not 0"


def _kto_trainer(model_dir: Path, policy: Path, tmp_path: Path, **weights):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = _trl_args(KTOConfig, tmp_path, loss_type="kto", max_length=None, **weights)
    return KTOTrainer(
        model=_model(policy),
        ref_model=_model(model_dir),
        args=args,
        train_dataset=Dataset.from_list(_conversational(_kto_records())),
        processing_class=_tokenizer(model_dir),
    )


def test_kto_equals_trl(runs, model_dir):
    """Step 1 (policy = reference: every log-ratio and the KL 0) and step 2 of `scaletune train`
    against `KTOTrainer.compute_loss` on the same weights and records, TRL's own KL pairs included."""
    import torch

    cfg, run, tmp = runs["kto"]
    rows = _our_rows(cfg, tmp)
    for step, policy in ((1, model_dir), (2, _export(run, 1, tmp))):
        trainer = _kto_trainer(model_dir, policy, tmp / f"trl-{step}", **KTO_WEIGHTS)
        batch = _trl_batch(trainer)
        trl_kl = _trl_rows(batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
        assert sorted(trl_kl) == sorted(_ours(rows, "kl_")), "KL rows"
        trl_rows = _trl_rows(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        labels = [bool(x) for x in batch["label"]]
        ours = [(s, bool(r["desirable"])) for s, r in zip(_ours(rows, ""), rows)]
        assert sorted(zip(trl_rows, labels)) == sorted(ours), "token ids / trained masks / labels"
        with torch.no_grad():
            trl_loss = float(trainer.compute_loss(trainer.model, batch))
        logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        got = _step(run, step)
        print(f"kto step {step}: scaletune {got['loss']!r} TRL {trl_loss!r}; kl {got['kl']!r} vs {logged['kl']!r}")
        _close(got["loss"], trl_loss, f"kto step {step} loss")
        _close(got["logp_chosen"], logged["logps/chosen"], f"kto step {step} logp_chosen (desirable)")
        _close(got["logp_rejected"], logged["logps/rejected"], f"kto step {step} logp_rejected (undesirable)")
        # kl is a mean of differences of sums of ~500 nats: float32 rounds it to a few 1e-6 absolute.
        assert abs(got["kl"] - logged["kl"]) <= 1e-5, f"kto step {step} kl: {got['kl']} vs {logged['kl']}"
        if step == 2:
            assert abs(logged["rewards/margins"]) > 1e-3, "step 2's log-ratios are not 0"


def test_kto_kl_pairs_equal_trl(runs, model_dir):
    """The KL estimate's mismatched (prompt, completion) sequences are the ones TRL pairs when the
    whole set is one batch: record i with completion (i - 1) mod N on both sides."""
    cfg, _, tmp = runs["kto"]
    rows = _our_rows(cfg, tmp)
    trainer = _kto_trainer(model_dir, model_dir, tmp / "trl-kl", **KTO_WEIGHTS)
    batch = _trl_batch(trainer)
    trl_kl = _trl_rows(batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
    assert sorted(trl_kl) == sorted(_ours(rows, "kl_")), "KL rows: TRL pairs prompt i with completion i - 1"


def _cpo_trainer(model_dir: Path, tmp_path: Path, **kw):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tok = _tokenizer(model_dir, plain_strings=True)
    args = _trl_args(CPOConfig, tmp_path, **kw)
    return CPOTrainer(
        model=_model(model_dir),
        args=args,
        train_dataset=Dataset.from_list(_rendered(_pairs(), tok)),
        processing_class=tok,
    )


def _cpo_rows(batch) -> list[tuple]:
    """CPO's/ORPO's pairs: (chosen, rejected) rows, unpadded, trained = label not -100."""
    out = []
    for side in ("chosen", "rejected"):
        ids, att, labels = batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], batch[f"{side}_labels"]
        out.append(_trl_rows(ids, att, labels != -100))
    return sorted(zip(*out))


def _pair_rows(cfg: dict, tmp: Path) -> list[tuple]:
    rows = _our_rows(cfg, tmp)
    return sorted(zip(_ours(rows, "chosen_"), _ours(rows, "rejected_")))


def test_simpo_equals_trl_cpo(runs, model_dir):
    """Step 1 of SimPO against `CPOTrainer.compute_loss` (loss_type simpo, cpo_alpha 0: no NLL)."""
    import torch

    cfg, run, tmp_path = runs["simpo"]
    trainer = _cpo_trainer(
        model_dir,
        tmp_path,
        beta=SIMPO["beta"],
        loss_type="simpo",
        cpo_alpha=0.0,
        simpo_gamma=SIMPO["gamma"],
        label_smoothing=SIMPO["label_smoothing"],
        max_length=1024,
    )
    batch = _trl_batch(trainer)
    assert _cpo_rows(batch) == _pair_rows(cfg, tmp_path), "token ids / trained masks"
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model, batch))
    logged = {k: v[-1] for k, v in trainer._stored_metrics["train"].items()}
    got = _step(run, 1)
    print(f"simpo step 1: scaletune {got['loss']!r} TRL {trl_loss!r}")
    _close(got["loss"], trl_loss, "simpo step 1 loss")
    # A step-1 margin is a difference of two rewards that nearly cancel (-0.0038 on the tests' tiny
    # model): it is held to float32's rounding of the rewards themselves (measured 2.4e-6), not to 1e-4 of
    # a near-zero difference.
    _close(got["reward_margin"], logged["rewards/margins"], "simpo step 1 reward_margin", rel=1e-4, atol=1e-5)


def test_orpo_equals_trl(runs, model_dir):
    """Step 1 of ORPO: scaletune's loss = the chosen answers' token-mean NLL (TRL's CPOTrainer
    `nll_loss`, prompt masked) + the odds-ratio term (TRL's ORPOTrainer, `-beta * log_odds_ratio`).
    TRL's own ORPO loss takes the NLL over the prompt too: printed, and checked to differ by exactly
    that."""
    import torch
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    cfg, run, tmp_path = runs["orpo"]
    tok = _tokenizer(model_dir, plain_strings=True)
    orpo = ORPOTrainer(
        model=_model(model_dir),
        args=_trl_args(ORPOConfig, tmp_path / "orpo", max_length=1024),
        train_dataset=Dataset.from_list(_rendered(_pairs(), tok)),
        processing_class=tok,
    )
    batch = _trl_batch(orpo)
    assert _cpo_rows(batch) == _pair_rows(cfg, tmp_path), "token ids / trained masks"
    with torch.no_grad():
        trl_orpo = float(orpo.compute_loss(orpo.model, batch))
    orpo_logged = {k: v[-1] for k, v in orpo._stored_metrics["train"].items()}
    cpo = _cpo_trainer(model_dir, tmp_path / "cpo", loss_type="sigmoid", cpo_alpha=1.0, max_length=1024)
    cpo_batch = _trl_batch(cpo)
    with torch.no_grad():
        cpo.compute_loss(cpo.model, cpo_batch)
    nll_answer = cpo._stored_metrics["train"]["nll_loss"][-1]
    odds_ratio_term = -BETA * orpo_logged["log_odds_ratio"]
    got = _step(run, 1)
    print(
        f"orpo step 1: scaletune {got['loss']!r}; TRL answer NLL {nll_answer!r} + odds-ratio term {odds_ratio_term!r}"
        f" = {nll_answer + odds_ratio_term!r}; TRL's ORPO loss (NLL over prompt and answer) {trl_orpo!r}"
    )
    _close(got["loss"], nll_answer + odds_ratio_term, "orpo step 1 loss")
    _close(trl_orpo - odds_ratio_term, orpo_logged["nll_loss"], "TRL's ORPO = its NLL + the odds-ratio term")
    # As SimPO's step-1 margin above (-0.00019 here; measured difference 8.9e-8).
    _close(got["reward_margin"], orpo_logged["rewards/margins"], "orpo step 1 reward_margin", rel=1e-4, atol=1e-5)

"""`scaletune eval MODEL --tasks` through the CLI: EleutherAI's lm-evaluation-harness on the shipped
alpaca_mc task, offline. Control: every choice's log-likelihood and the accuracy recomputed here with
transformers (and peft for the adapter) directly, from the task's JSONL, not through scaletune or
lm-eval; on a random model and on a LoRA run trained on those items (the adapter merged by scaletune
for the harness, unmerged here). Bad arguments: exit 2 with every problem."""

from __future__ import annotations

import json
import math

import pytest

from scaletune.inference.lm_eval_tasks import TASKS_DIR
from tests.helpers import ALPACA_5000, make_config, run_cli, train

pytest.importorskip("lm_eval")

TASK_FILE = TASKS_DIR / "alpaca_mc.jsonl"
LIMIT = 12


def _items(n: int) -> list[dict]:
    return [json.loads(line) for line in TASK_FILE.read_text().splitlines()[:n]]


def _choice_logprobs(model, tok, context: str, choices: list[str]) -> list[float]:
    """Sum of log p(choice tokens | context), the choice tokens being those of `context + " " +
    choice` after the tokens of `context` (lm-eval's split for a causal model: the delimiter's
    space goes with the continuation)."""
    import torch

    ctx = tok(context)["input_ids"]
    out = []
    for choice in choices:
        whole = tok(context + " " + choice)["input_ids"]
        assert whole[: len(ctx)] == ctx
        ids = torch.tensor([whole])
        with torch.no_grad():  # the positions that predict the choice's tokens
            logp = torch.log_softmax(model(ids).logits[0, len(ctx) - 1 : -1].double(), dim=-1)
        out.append(float(logp.gather(1, ids[0, len(ctx) :, None]).sum()))
    return out


def _rolling_logprob(model, tok, text: str) -> float:
    """log p(text): every token of the text given those before it, the first given the prefix token
    (BOS, else EOS), as lm-eval's loglikelihood_rolling for a text shorter than the context window."""
    import torch

    ids = tok(text)["input_ids"]
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[prefix, *ids[:-1]]])).logits[0].double(), dim=-1)
    return float(logp.gather(1, torch.tensor(ids)[:, None]).sum())


def _independent(model, tok, n: int) -> tuple[list[list[float]], float, float]:
    lls, acc, acc_norm = [], 0, 0
    for item in _items(n):
        ll = _choice_logprobs(model, tok, item["context"], item["choices"])
        lls.append(ll)
        acc += max(range(len(ll)), key=ll.__getitem__) == item["label"]
        norm = [v / len(c) for v, c in zip(ll, item["choices"])]  # lm-eval: characters of the choice
        acc_norm += max(range(len(norm)), key=norm.__getitem__) == item["label"]
    return lls, acc / n, acc_norm / n


def _check_against_harness(report: dict, model, tok) -> dict:
    lls, acc, acc_norm = _independent(model, tok, LIMIT)
    samples = sorted(report["samples"]["alpaca_mc"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(LIMIT))
    assert [s["target"] for s in samples] == [it["label"] for it in _items(LIMIT)]
    for s, mine in zip(samples, lls):
        assert s["loglikelihoods"] == pytest.approx(mine, abs=2e-3, rel=1e-5), s["doc_id"]
    res = report["results"]["alpaca_mc"]
    assert res["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert res["acc_norm,none"] == pytest.approx(acc_norm, abs=1e-12)
    assert report["n-samples"]["alpaca_mc"]["effective"] == LIMIT
    return {"acc": acc, "acc_norm": acc_norm, "lls": lls}


def test_random_model_accuracy_equals_log_probs_computed_directly(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    tasks = "alpaca_mc,alpaca_ppl"
    proc = run_cli(["eval", str(tiny_model_dir), "--tasks", tasks, "--limit", str(LIMIT), "-o", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "alpaca_ppl" in proc.stdout and "acc_norm" in proc.stdout  # the harness's table
    (path,) = out.glob("lm_eval-*.json")
    assert path.with_suffix(".md").read_text() in proc.stdout
    report = json.loads(path.read_text())
    # The control below scores the task's own text with no chat template: the label says so.
    said = "prompts: each task's own, zero-shot (no chat template)"
    assert said in proc.stdout and said in report["model"] and "prompts: chat" not in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    got = _check_against_harness(report, model, tok)
    # alpaca_ppl: each item's question and right answer as one text, and the corpus-level ratios.
    texts = [f"{it['context']} {it['choices'][it['label']]}" for it in _items(LIMIT)]
    lls = [_rolling_logprob(model, tok, t) for t in texts]
    samples = sorted(report["samples"]["alpaca_ppl"], key=lambda s: s["doc_id"])
    assert [s["loglikelihoods"][0] for s in samples] == pytest.approx(lls, abs=2e-3, rel=1e-5)
    ppl = report["results"]["alpaca_ppl"]
    n_bytes, n_words = sum(len(t.encode()) for t in texts), sum(len(t.split()) for t in texts)
    assert ppl["bits_per_byte,none"] == pytest.approx(-sum(lls) / n_bytes / math.log(2), rel=1e-5)
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / n_words), rel=1e-4)
    print(f"random model: acc {got['acc']:.3f} acc_norm {got['acc_norm']:.3f} on {LIMIT} items")


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, module_tmp_path):
    """A LoRA run trained on the alpaca records behind the first LIMIT items (their own answers)."""
    records = json.loads(ALPACA_5000.read_text())
    idx = [int(it["id"].removeprefix("alpaca_5000[").removesuffix("]")) for it in _items(LIMIT)]
    (module_tmp_path / "train.json").write_text(json.dumps([records[i] for i in idx]))
    cfg = make_config(
        tiny_model_dir,
        module_tmp_path / "run",
        model={"lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        data={"train": {"path": str(module_tmp_path / "train.json"), "max_samples": None}, "max_seq_length": 128},
        training={"max_steps": 8, "learning_rate": 2e-2, "save_every": 8, "micro_batch_size": 4, "warmup_steps": 2},
    )
    train(cfg, module_tmp_path)
    return module_tmp_path / "run"


def test_trained_lora_run_writes_its_eval_folder_and_matches_peft_directly(trained_run, tiny_model_dir):
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = run_cli(["eval", str(trained_run), "--tasks", " alpaca_mc, ", "--limit", str(LIMIT), "--json"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = (trained_run / "eval").glob("lm_eval-*.json")
    assert json.loads(proc.stdout)["file"] == str(path)
    report = json.loads(path.read_text())
    assert "LoRA adapter" in report["model"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    model = peft.PeftModel.from_pretrained(base, str(trained_run / "final")).eval()  # not merged
    tok = AutoTokenizer.from_pretrained(trained_run / "final")
    got = _check_against_harness(report, model, tok)
    # The adapter changed the answers' likelihoods: the harness saw the trained model, not the base
    # (which it would match exactly). Trained on these items' right answers, their summed
    # log-likelihood rises (+5.8 nats over 48 choices when measured); a per-choice difference far
    # above the 2e-3 agreement with the harness says which model was scored.
    with model.disable_adapter():
        base_lls, base_acc, _ = _independent(model, tok, LIMIT)
    assert sum(map(sum, got["lls"])) > sum(map(sum, base_lls)) + 1
    assert max(abs(a - b) for g, r in zip(got["lls"], base_lls) for a, b in zip(g, r)) > 0.1
    print(f"trained LoRA run: acc {got['acc']:.3f} (base {base_acc:.3f}) acc_norm {got['acc_norm']:.3f}")


def test_bad_arguments_exit_2_with_every_problem(tiny_model_dir, tmp_path):
    proc = run_cli(["eval", str(tiny_model_dir), "--tasks", "alpaca_mc,nope,hellaswag", "--data", "x.json"])
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "exactly one of --data" in err and "'nope'" in err and "'hellaswag'" in err
    assert "available tasks: alpaca_mc, alpaca_ppl" in err and "Traceback" not in err
    proc = run_cli(["eval", str(tiny_model_dir), "--limit", "3"])  # neither; --limit alone is no choice
    assert proc.returncode == 2 and "exactly one of --data" in proc.stderr
    proc = run_cli(["eval", str(tiny_model_dir), "--data", str(ALPACA_5000), "--limit", "3", "-o", str(tmp_path)])
    assert proc.returncode == 2
    assert "--limit applies to --tasks" in proc.stderr and "--output applies to --tasks" in proc.stderr
    proc = run_cli(["eval", str(tiny_model_dir), "--tasks", ",", "--format", "messages", "--template", "chat"])
    assert proc.returncode == 2 and "--template chat applies to --data" in proc.stderr
    assert "name at least one task" in proc.stderr and "--format applies to --data" in proc.stderr

"""Online RL (issue 36): a GRPO step is the same computation on 1, 2 or 3 ranks, and a run's
rollouts.jsonl records exactly what it trained on.

Data: 12 training and 5 held-out prompts from the real Alpaca records (the instruction as the
prompt, the first word of the record's output as `answer`), rendered with the tiny model's ChatML
template. Rewards: `exact_answer` and `length_penalty` (max_chars 40, weight 0.5), whose values
vary with the sampled text, so groups have variance and the steps have gradients.

The runs, full fine-tuning in fp32 with a KL to the reference model (beta 0.04, `reference: model`),
sampling at temperature 1.0 from the top_p 0.95 nucleus:

- `hf`: one process, the `hf` engine samples every training and evaluation rollout;
- `replay`: one process, `engine: replay` of `hf`'s rollouts.jsonl: the same completions, so the
  same losses, gradient norms, rewards and advantages (1e-6);
- `ddp-hf`: `scaletune train` with num_processes 2 (re-executed under torchrun), DDP, 2 SFT steps
  then 4 GRPO steps in one run, two on each generation (`steps_per_generation` 2), sampling with
  the `hf` engine on each rank (its own completions), and `ddp-replay`, one process replaying them:
  world size 2 reproduces world size 1 on the same completions (1e-4); `resumed-1` (one process,
  replaying) and `resumed-2` (two, hf) resume from its checkpoint inside the GRPO stage and
  continue as it did;
- `zero2-2` (one torchrun) and `fsdp-3` (torchrun, 3 ranks: 6 prompts a step and 5 held-out
  prompts are uneven shares) replay `hf`'s rollouts and reproduce it (1e-4);
- `zero3-2` (`torchrun -m scaletune train`) and `fsdp-2` (in zero2-2's torchrun) sample with the
  `hf` engine under DeepSpeed ZeRO-3 and FSDP2, whose every forward gathers parameters from both
  ranks, from a model whose completions end early and unevenly (:func:`eos_prone_model`), so one
  rank's generation ends before the other's; `zero3-replay` and `fsdp-replay`, one process
  replaying each, reproduce them (1e-4).

Every run's trainer recomputes the log-probs its completions were sampled at, renormalised on the
nucleus (the hf engine's, or the replayed file's, recorded as the control's engine sampled them),
within 1e-5 nats a token (`logp_mismatch`), and the hf run's `entropy` is that of the distribution
it sampled from.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import ALPACA_5000, assert_close, make_config, metrics, run_cli, steps, train, train_batch

pytestmark = pytest.mark.distributed

REL = 1e-4
G = 4
# Trainer vs engine log-probs of the same tokens (`logp_mismatch`, nats a token): fp32 on the CPU.
AGREE = 1e-5
# Nucleus sampling: the engine samples from it and the trainer renormalises on it (a real cut of
# the random model's near-uniform distribution: the 5 % least likely tokens).
TOP_P = 0.95


def _prompts(records: list[dict]) -> list[dict]:
    return [{"prompt": r["instruction"], "answer": r["output"].split()[0]} for r in records]


@pytest.fixture(scope="module")
def prompt_files(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, int]:
    """(train file, eval file, their prompts' length in tokens): Alpaca instructions whose prompts,
    rendered as the run renders them (ChatML, the tiny model has no template), are all the same
    length, the commonest; `data.max_seq_length` is set to it, so every generation's KV cache is the
    size the planner gives for the longest prompt (test_the_plans_kv_cache_is_the_engines)."""
    from collections import Counter

    from transformers import AutoTokenizer

    from scaletune.data.templates import CHATML_TEMPLATE, render_chat

    records = [r for r in json.loads(ALPACA_5000.read_text()) if not r["input"] and len(r["instruction"]) < 90][:400]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    texts = render_chat(
        tokenizer, CHATML_TEMPLATE, [[{"role": "user", "content": r["instruction"]}] for r in records], True
    )
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    length = Counter(lengths).most_common(1)[0][0]
    same = [r for r, n in zip(records, lengths) if n == length]
    assert len(same) >= 17, Counter(lengths).most_common(3)
    folder = tmp_path_factory.mktemp("prompts")
    out = []
    for name, part in (("train", same[:12]), ("eval", same[12:17])):
        path = folder / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(p) for p in _prompts(part)) + "\n")
        out.append(path)
    return out[0], out[1], length


# The layouts that sample with the hf engine through sharded parameters (each replayed on one process).
SAMPLING_SHARDED = {"zero3-2": {"strategy": "deepspeed", "zero_stage": 3}, "fsdp-2": {"strategy": "fsdp"}}
# The end-of-sequence token made likely everywhere (:func:`eos_prone_model`).
EOS_PUSH, EOS_GAIN = 10.0, 1.5  # completions of 1-8 tokens (of 8 at most)


@pytest.fixture(scope="module")
def eos_prone_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model whose sampled completions end early and at uneven lengths (a random model's
    almost never end: 1 in 27,110 a token): every token's embedding holds EOS_PUSH in dimension 0,
    which the residual stream carries to the final norm (positive there), and the head's row of the
    end-of-sequence token reads that dimension with weight EOS_GAIN."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("models") / "eos-prone"
    shutil.copytree(tiny_model_dir, out)
    eos = AutoTokenizer.from_pretrained(str(out)).eos_token_id
    weights = load_file(str(out / "model.safetensors"))
    weights["model.embed_tokens.weight"][:, 0] = EOS_PUSH
    weights["lm_head.weight"][eos, 0] = EOS_GAIN
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _config(model: Path, out: Path, files: tuple[Path, Path, int], **distributed) -> dict:
    train_file, eval_file, prompt_tokens = files
    return make_config(
        model,
        out,
        data={
            "train": {"path": str(train_file), "format": "prompt"},
            "eval": {"path": str(eval_file), "format": "prompt"},
            "max_seq_length": prompt_tokens,
        },
        training={
            "objective": "grpo",
            "global_batch_size": 6,
            "micro_batch_size": 1,
            "max_steps": 3,
            "eval_every": 2,
            "save_every": 0,
            "rl": {
                "num_generations": G,
                "max_new_tokens": 8,
                "top_p": TOP_P,
                "beta": 0.04,
                "loss": "dapo",
                "rewards": [
                    {"function": "scaletune.rewards:exact_answer"},
                    {"function": "scaletune.rewards:length_penalty", "weight": 0.5, "kwargs": {"max_chars": 40}},
                ],
            },
        },
        distributed={"strategy": "single", "num_processes": 1, **distributed},
    )


def _replaying(cfg: dict, source: Path) -> dict:
    replay = {"engine": "replay", "replay": str(source / "rollouts.jsonl")}
    if cfg.get("stages"):
        stages = [dict(st) for st in cfg["stages"]]
        grpo = stages[-1]["training"]
        stages[-1]["training"] = {**grpo, "rl": {**grpo["rl"], **replay}}
        return {**cfg, "stages": stages}
    rl = {**cfg["training"]["rl"], **replay}
    return {**cfg, "training": {**cfg["training"], "rl": rl}}


def _staged(cfg: dict, **training) -> dict:
    """`cfg` as a curriculum: 2 SFT steps on Alpaca records, then its GRPO stage, 4 steps trained
    2 on each generation (`steps_per_generation` 2: steps 3 and 4 sampled before step 3, 5 and 6
    before step 5); `save_every` 3 falls inside the first generation, so its checkpoint is written
    after the generation's last step (step 4)."""
    grpo_data = cfg["data"]
    data = {
        "train": {"path": str(ALPACA_5000), "format": "alpaca", "max_samples": 24},
        "eval": None,
        "max_seq_length": 64,
    }
    stages = [
        {"name": "sft", "training": {"objective": "sft", "max_steps": 2}},
        {
            "name": "grpo",
            "training": {
                "objective": "grpo",
                "max_steps": 4,
                "rl": {**cfg["training"]["rl"], "steps_per_generation": 2},
            },
            "data": {k: grpo_data[k] for k in ("train", "eval", "max_seq_length")},
        },
    ]
    top = {k: v for k, v in cfg["training"].items() if k not in ("objective", "rl", "max_steps")}
    return {**cfg, "data": {**cfg["data"], **data}, "training": {**top, "save_every": 3, **training}, "stages": stages}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, eos_prone_model, prompt_files, module_tmp_path) -> dict[str, Path]:
    base = module_tmp_path
    names = (
        "hf",
        "replay",
        "ddp-hf",
        "ddp-replay",
        "resumed-1",
        "resumed-2",
        "fsdp-2",
        "zero2-2",
        "zero3-2",
        "zero3-replay",
        "fsdp-replay",
        "fsdp-3",
    )
    out = {name: base / name for name in names}
    hf = _config(tiny_model_dir, out["hf"], prompt_files)
    train(hf, base, name="hf.yaml")
    train(_replaying(_config(tiny_model_dir, out["replay"], prompt_files), out["hf"]), base, name="replay.yaml")
    ddp = _staged(_config(tiny_model_dir, out["ddp-hf"], prompt_files, strategy="ddp", num_processes=2))
    train(ddp, base, name="ddp-hf.yaml")  # the plain command: re-executes under torchrun
    replay_ddp = _replaying(_staged(_config(tiny_model_dir, out["ddp-replay"], prompt_files)), out["ddp-hf"])
    train(replay_ddp, base, name="ddp-replay.yaml")
    # Resumed inside the GRPO stage (step 4's checkpoint) on one process, replaying the rest.
    inside = str(out["ddp-hf"] / "checkpoints" / "step-4")
    resumed = _replaying(_staged(_config(tiny_model_dir, out["resumed-1"], prompt_files), resume=inside), out["ddp-hf"])
    train(resumed, base, name="resumed-1.yaml")
    zero2 = _config(tiny_model_dir, out["zero2-2"], prompt_files, strategy="deepspeed", zero_stage=2, num_processes=2)
    batch = {"zero2-2": _replaying(zero2, out["hf"])}
    # ZeRO-3 and fsdp sample with the hf engine itself, through the parameters they shard: ZeRO-3 as
    # a user starts it (torchrun), fsdp in the batch.
    zero3 = _config(eos_prone_model, out["zero3-2"], prompt_files, num_processes=2, **SAMPLING_SHARDED["zero3-2"])
    train(zero3, base, name="zero3-2.yaml", launcher="torchrun")
    batch["fsdp-2"] = _config(
        eos_prone_model, out["fsdp-2"], prompt_files, num_processes=2, **SAMPLING_SHARDED["fsdp-2"]
    )
    # Resumed on its own world size with the hf engine: each call's sampling seed drawn again, the prompt position restored.
    batch["resumed-2"] = _staged(
        _config(tiny_model_dir, out["resumed-2"], prompt_files, strategy="ddp", num_processes=2), resume=inside
    )
    train_batch(batch, base / "batch")
    for name in SAMPLING_SHARDED:
        replay = name.replace("-2", "-replay")
        train(_replaying(_config(eos_prone_model, out[replay], prompt_files), out[name]), base, name=f"{replay}.yaml")
    fsdp3 = _replaying(
        _config(tiny_model_dir, out["fsdp-3"], prompt_files, strategy="fsdp", num_processes=3), out["hf"]
    )
    train(fsdp3, base, name="fsdp-3.yaml", launcher="torchrun")
    return out


def _rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines() if line.strip()]


def _evals(run: Path) -> list[dict]:
    return [m for m in metrics(run) if "eval_loss" in m]


def _assert_reproduces(run: Path, control: Path, rel: float, what: str) -> None:
    mine, ref = steps(run), steps(control)
    assert [m["step"] for m in mine] == [m["step"] for m in ref] == [1, 2, 3]
    for key in ("loss", "grad_norm", "reward", "reward_std", "completion_length", "kl"):
        assert_close([m[key] for m in mine], [m[key] for m in ref], rel, f"{what} {key}")
    assert [m["zero_variance_groups"] for m in mine] == [m["zero_variance_groups"] for m in ref]
    # The trainer's log-probs on this layout against those the control's engine recorded as it sampled.
    assert all(m["logp_mismatch"] < AGREE for m in mine + ref), [m["logp_mismatch"] for m in mine + ref]
    e_mine, e_ref = _evals(run), _evals(control)
    assert [m["step"] for m in e_mine] == [m["step"] for m in e_ref] == [2, 3]
    for key in ("eval_loss", "eval_reward"):
        assert_close([m[key] for m in e_mine], [m[key] for m in e_ref], rel, f"{what} {key}")


def test_the_hf_runs_rollouts_are_whole_groups_with_trls_advantages(runs):
    """Every prompt of a step has G completions on rollouts.jsonl; each advantage is
    (r - mean) / (std + 1e-4) of its group, recomputed here with `statistics`; the reward is the
    weighted sum of the functions' values; the steps trained (non-zero loss and gradient)."""
    lines = [r for r in _rollouts(runs["hf"]) if r["split"] == "train"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in lines:
        groups[(r["step"], r["prompt_index"])].append(r)
    assert len(lines) == 3 * 6 * G and all(len(g) == G for g in groups.values())
    assert {s for s, _ in groups} == {1, 2, 3}
    for group in groups.values():
        rewards = [r["reward"] for r in group]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        for r in group:
            assert r["reward"] == pytest.approx(r["reward_exact_answer"] + 0.5 * r["reward_length_penalty"], abs=1e-6)
            assert r["advantage"] == pytest.approx((r["reward"] - mean) / (std + 1e-4), abs=1e-4)
            assert r["policy_version"] == r["step"] - 1
            assert 1 <= len(r["completion_ids"]) <= 8
            assert len(r["completion_logps"]) == len(r["completion_ids"]) and max(r["completion_logps"]) <= 0
    evals = [r for r in _rollouts(runs["hf"]) if r["split"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [2, 3] and len(evals) == 2 * 5 * G
    m = steps(runs["hf"])
    from scaletune.config.preference import OBJECTIVES

    # every metric key the table of facts names for grpo, and one per reward function
    assert set(OBJECTIVES["grpo"].metrics) | {"reward_exact_answer", "reward_length_penalty"} <= set(m[0])
    assert all(s["loss"] != 0 and s["grad_norm"] > 0 for s in m)
    assert all(0 <= s["zero_variance_groups"] <= 6 for s in m) and any(s["reward_std"] > 0 for s in m)
    assert all(s["kl"] >= 0 for s in m) and m[-1]["kl"] > 0  # the policy has moved from the reference
    # The engine sampled from the trained weights: the trainer recomputes its log-probs (AGREE). Its
    # entropy is of the distribution sampled from: the mean surprisal of what it sampled estimates it.
    assert all(s["logp_mismatch"] < AGREE for s in m), [s["logp_mismatch"] for s in m]
    for s in m:
        sampled = [-v for r in lines if r["step"] == s["step"] for v in r["completion_logps"]]
        assert s["entropy"] == pytest.approx(statistics.fmean(sampled), rel=0.05)


def test_a_replay_of_the_rollouts_trains_the_same_steps(runs):
    _assert_reproduces(runs["replay"], runs["hf"], 1e-6, "replay of hf")
    mine, ref = _rollouts(runs["replay"]), _rollouts(runs["hf"])
    assert [r["completion_ids"] for r in mine] == [r["completion_ids"] for r in ref]
    for key in ("reward", "advantage"):
        assert [r[key] for r in mine] == pytest.approx([r[key] for r in ref], abs=1e-6)


def test_sft_then_grpo_on_ddp_with_the_hf_engine_equals_one_process_on_its_completions(runs):
    """2 SFT steps then 4 GRPO steps in one run, 2 a generation, at world size 2 (each rank sampled
    its prompts' groups; rank 0 wrote both ranks' lines) and replayed at world size 1: every step
    agrees. A generation's second step trains on completions the policy before its first sampled,
    its ratio taken to the log-probs the trainer computed for them at sampling: those equal the
    ones the engine recorded as it sampled (`logp_mismatch`, AGREE), where the moved policy's
    would not."""
    lines = [r for r in _rollouts(runs["ddp-hf"]) if r["split"] == "train"]
    assert sorted({r["step"] for r in lines}) == [3, 4, 5, 6]
    assert len(lines) == 4 * 6 * G
    assert {(r["step"], r["policy_version"]) for r in lines} == {(3, 2), (4, 2), (5, 4), (6, 4)}
    mine, ref = steps(runs["ddp-replay"]), steps(runs["ddp-hf"])
    assert [m["stage"] for m in ref] == ["sft", "sft", "grpo", "grpo", "grpo", "grpo"]
    for key in ("loss", "grad_norm"):
        assert_close([m[key] for m in mine], [m[key] for m in ref], REL, f"sft then grpo, world size 2 vs 1: {key}")
    for key in ("reward", "reward_std", "kl"):
        assert_close([m[key] for m in mine[2:]], [m[key] for m in ref[2:]], REL, key)
    grpo_steps = mine[2:] + ref[2:]
    assert all(m["logp_mismatch"] < AGREE for m in grpo_steps), [m["logp_mismatch"] for m in grpo_steps]
    # save_every 3 inside the first generation: written after its last step instead, and at the end.
    assert sorted(p.name for p in (runs["ddp-hf"] / "checkpoints").glob("step-*")) == ["step-4", "step-6"]


@pytest.mark.parametrize("name", ["resumed-1", "resumed-2"])
def test_a_run_resumed_inside_the_grpo_stage_continues_as_the_uninterrupted_one(runs, name):
    """From the checkpoint after the GRPO stage's first generation (step 4): on one process
    replaying the uninterrupted run's completions (another world size samples differently), and on
    two with the hf engine (each call's sampling seed drawn again and the prompt position restored:
    the same completions again)."""
    mine, ref = steps(runs[name]), steps(runs["ddp-hf"])
    assert [m["step"] for m in mine] == [5, 6]
    for key in ("loss", "grad_norm", "reward", "reward_std", "kl"):
        assert_close([m[key] for m in mine], [m[key] for m in ref[4:]], REL, f"{name} {key}")
    if name == "resumed-2":
        resumed = [r["completion_ids"] for r in _rollouts(runs[name]) if r["split"] == "train"]
        uninterrupted = [
            r["completion_ids"] for r in _rollouts(runs["ddp-hf"]) if r["split"] == "train" and r["step"] > 4
        ]
        assert resumed == uninterrupted


@pytest.mark.parametrize("layout", ["zero2-2", "fsdp-3"])
def test_layout_reproduces_the_single_process_run(runs, layout):
    _assert_reproduces(runs[layout], runs["hf"], REL, layout)


@pytest.mark.parametrize("layout", list(SAMPLING_SHARDED))
def test_sharded_hf_sampling_ends_unevenly_and_equals_one_process_on_its_completions(runs, layout):
    """Under ZeRO-3 and fsdp each rank's generate runs until both ranks' completions have ended (a
    rank that stopped first would leave the other in an all-gather): the run finished, some
    micro-batch's completions ended at another length on one rank than on the other, and one
    process replaying its completions trains the same steps (1e-4)."""
    lines = [r for r in _rollouts(runs[layout]) if r["split"] == "train"]
    assert len(lines) == 3 * 6 * G
    longest: dict[tuple[int, int, int], int] = {}  # (step, micro-batch, rank) -> its longest completion
    for i, r in enumerate(lines):
        rank, within = divmod(i % (6 * G), 3 * G)  # a step's lines: rank 0's 3 prompts x G, then rank 1's
        key = (r["step"], within // G, rank)
        longest[key] = max(longest.get(key, 0), len(r["completion_ids"]))
    uneven = [(s, m) for (s, m, rank) in longest if rank == 0 and longest[s, m, 0] != longest[s, m, 1]]
    assert uneven, longest
    assert min(len(r["completion_ids"]) for r in lines) < 8
    replay = layout.replace("-2", "-replay")
    _assert_reproduces(runs[replay], runs[layout], REL, f"{layout} world size 2 (hf engine) vs 1")


def test_the_plans_kv_cache_is_the_engines(runs, tiny_model_dir, prompt_files):
    """The planner's generation term (plan.json, and its arithmetic in `scaletune plan`) equals the
    largest KV cache the hf engine held (memory.json, from the cache's tensors): micro_batch_size 1
    x G completions x (prompt + 8 new - 1) tokens x layers x 2 (K, V) x kv heads x head_dim x 4
    bytes, each factor read here from the model's config.json; the engine's own weights are 0 (the
    trained module generates). A replay holds no cache."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    prompt = prompt_files[2]
    expected = 1 * G * (prompt + 8 - 1) * layers * 2 * kv_heads * head_dim * 4
    planned = json.loads((runs["hf"] / "plan.json").read_text())
    measured = json.loads((runs["hf"] / "memory.json").read_text())["ranks"]
    assert planned["per_rank_bytes"]["kv_cache"] == expected == measured[0]["kv_cache"], (planned, measured)
    assert planned["rollout"]["engine"] == "hf" and planned["rollout"]["engine_weights"] == 0
    for run in ("zero2-2", "fsdp-3"):
        ranks = json.loads((runs[run] / "memory.json").read_text())["ranks"]
        assert [r["kv_cache"] for r in ranks] == [0] * len(ranks)
        assert json.loads((runs[run] / "plan.json").read_text())["per_rank_bytes"]["kv_cache"] == 0
    said = run_cli(["plan", str(runs["hf"].parent / "hf.yaml")])
    assert said.returncode == 0, said.stderr[-2000:]
    assert (
        f"KV cache = {G} rows (micro_batch_size x num_generations) x ({prompt} prompt + 8 new - 1) tokens x "
        f"{layers} layers x 2 (K, V) x {kv_heads} kv heads x {head_dim} head_dim x 4 bytes"
    ) in said.stdout, said.stdout

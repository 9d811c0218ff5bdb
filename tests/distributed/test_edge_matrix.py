"""The edges a user meets after the even-shard parity runs, under ddp, fsdp, ZeRO-1, ZeRO-2 and
ZeRO-3 at world sizes 2 and 3, each the command line a user types (`scaletune train CONFIG
key=value ... distributed.num_processes=N`) and compared with the single-process run of the same
config (fp32: loss, grad_norm, lr and eval_loss of metrics.jsonl within 1e-5, relative; the sample
answers equal).

One config holds every edge, so each (strategy, world size) is one run:

* eval sets whose rows do not split into the same number of micro-batches on every rank (13 rows
  in stage `a`; 1 row in stage `b`, so some ranks hold none): FSDP and ZeRO-3 gather parameters
  in every forward, so a rank with fewer eval micro-batches left the others in an all-gather;
* a last partial global batch (58 rows, 12 a step: 10 dropped) and 1.5 epochs, so stage `a`
  crosses an epoch boundary;
* an eval before the first step, every 2 steps and at each stage end (a stage boundary with an
  eval), `sample_prompts` answered before and after training;
* a curriculum boundary (issue 35): stage `b` continues stage `a`'s schedule and freezes the
  adapters of layer 0, which stage `a` trained (the engine is re-targeted at the boundary);
* checkpoints at stage `a`'s end (step 6) and inside stage `b` (step 8, with layer 0 frozen),
  each written right after an eval.

**The stage-boundary matrix** rides on those runs: every (strategy, world size) run is resumed
twice, once from stage `a`'s end and once from inside stage `b`; one of the two on the same world
size, the other on the other one (2 -> 3, 3 -> 2). So each engine is resumed {at a stage's end,
mid-stage} x {same world size, another world size}, and every resumed step (loss, grad norm, lr,
eval) equals the single-process run (1e-5 on the same world size, 1e-4 resharded), and the frozen
adapters end bit-identical to the run resumed from. LoRA dropout is 0 here, since dropout masks are
drawn per rank and cannot equal one process's; the RNG restored at a stage's end is
tests/e2e/test_curriculum.py's, and per rank tests/distributed/test_resume.py's.

**LoRA out of every engine** rides on them too (the failures users meet: empty or shard-sized
adapters after ZeRO-3, merges that fail after FSDP): for the single process and every engine at
world size 2, final/'s adapter is whole and trained, bit for bit what `scaletune export`
consolidates in another process from the run's last (sharded) checkpoint, and the single process's
function within the parity bound. `--merge-lora` (base + adapter within 1e-5) is run on the single
process's run: a run directory's merge reads final/, a peft adapter folder whatever engine wrote it,
which those checks prove whole and equal to the control's, so an engine's merge would repeat it.

Also: a dataset smaller than one global batch (exit 2, one message, no traceback) and your own
model (`model.factory`, examples/digits) across two processes through the real command.

How they start (:data:`USER_CASES`): ZeRO-3 at 2 exactly as users start it, the run and its
same-world-size resume through the plain command (which re-executes under torchrun and sizes each
rank's threads; the run's torchrun and ranks are new interpreters, as users' are, where the suite's
others, the resume's included, are forks of the test worker's zygote: tests/forked_cli.py
delegate), the resharding resume onto 3 through `torchrun -m scaletune train`. The other nine
cases pass the same command lines to `scaletune.cli.main` one after another in the ranks of three
torchruns
(tests/distributed/sequential_runs.py): their subject is the engines' arithmetic and files, which
does not depend on the process being fresh, and what the plain command adds around the loop is the
user cases' (and every other distributed module's). A torchrun's ranks import torch and
transformers once for their 4-12 runs; each run's own processes did it before (the module took
1,888 CPU-s in CI at a9454a0, 121 processes).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import (
    BUNDLED_ALPACA,
    REPO_ROOT,
    assert_same_logits,
    logits,
    metrics,
    run_cli,
    run_torchrun,
    train_sequentially,
)

pytestmark = pytest.mark.distributed

REL = 1e-5
RESHARD_REL = 1e-4  # resumed on another world size: the optimizer state is re-cut (issue 35's bound)
TIMEOUT = 600  # per run; a run of this size takes 20-60 s on two busy cores, a hang the whole timeout
STRATEGIES = {
    "ddp": ["distributed.strategy=ddp"],
    "fsdp": ["distributed.strategy=fsdp"],
    "zero1": ["distributed.strategy=deepspeed", "distributed.zero_stage=1"],
    "zero2": ["distributed.strategy=deepspeed", "distributed.zero_stage=2"],
    "zero3": ["distributed.strategy=deepspeed", "distributed.zero_stage=3"],
}
# Every engine at world sizes 2 and 3. One case starts every run of its own as users start them: the
# run through the plain command (`scaletune train ... distributed.num_processes=N`, re-executed under
# torchrun), its resume on the same world size through the command named here, the other through
# `torchrun -m scaletune train`. The other nine run the same command lines one after another in
# the ranks of three torchruns (tests/distributed/sequential_runs.py), which import torch and
# transformers once for all of them where each run's processes did before. (ZeRO-2 at 3 was a
# second such case, under torchrun, until 2026-11-30: each of those commands is this case's, or
# tests/distributed/test_parity.py's, and its three runs cost ~150 CPU-s of process start-up.)
USER_CASES = {("zero3", 2): "scaletune"}
CASES = [(strategy, world) for world in (2, 3) for strategy in STRATEGIES]
DRIVEN = [case for case in CASES if case not in USER_CASES]
STAGE_END = 6  # stage a's last step: a stage-end checkpoint (stage_complete)
MID_STAGE = 8  # stage b's second of four steps, layer 0 frozen
# Which checkpoint a run of world size W resumes on W (the other on the other world size): with two
# runs an engine, each engine meets all four cells of {stage end, mid-stage} x {same, other}.
SAME_WORLD = {2: STAGE_END, 3: MID_STAGE}
OTHER_WORLD = {2: 3, 3: 2}
OTHER_STEP = {STAGE_END: MID_STAGE, MID_STAGE: STAGE_END}
# LoRA: the head stays frozen. A full fine-tune's gradient norm agrees across engines only to a few
# 1e-4 (the float32 norm of the head's 6.4M gradient values, summed in another order: GRAD_REL in
# tests/helpers.py); the adapters' norm agrees to 1e-5 like the loss.
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "auto"}
FROZEN_IN_B = "*layers.0.*"  # layer 0's adapters: trained in stage a, frozen in stage b


def eval_source(records: int) -> dict:
    return {"path": str(BUNDLED_ALPACA), "format": "alpaca", "max_samples": records}


def edge_config(model: Path, out: Path) -> dict:
    """The single-process config every case runs (the cases change only `distributed` and
    `output_dir`): LoRA on the tiny OLMo-2.

    58 training rows (64 records, 6 empty after truncation) in global batches of 12 (micro 2:
    accumulation 6, 3 and 2 at world sizes 1, 2 and 3); eval sets of 13 rows (16 records) and 1 row
    (2 records). Stage `a`: 1.5 epochs = 6 steps; stage `b`: 4 steps on the same cosine (10 in all),
    layer 0's adapters frozen."""
    return {
        "output_dir": str(out),
        "seed": 1234,
        "model": {"name_or_path": str(model), "dtype": "float32", "attn_implementation": "sdpa", "lora": LORA},
        "data": {
            "train": {"path": str(REPO_ROOT.parent / "shared" / "data" / "alpaca_5000.json"), "max_samples": 64},
            "eval": eval_source(16),
            "max_seq_length": 64,
        },
        "training": {
            "global_batch_size": 12,
            "micro_batch_size": 2,
            "learning_rate": 2.0e-3,
            "warmup_steps": 1,
            "eval_every": 2,
            "eval_on_start": True,
            "save_every": 4,
            "keep_last": 5,
            "sample_prompts": ["Name a colour."],
            "sample_max_new_tokens": 4,
        },
        # A hang (a rank left alone in a collective) fails in minutes, not at the 30-minute default.
        "distributed": {"strategy": "single", "num_processes": 1, "timeout_minutes": 3},
        "logging": {"tensorboard": False},
        "stages": [
            {"name": "a", "training": {"epochs": 1.5}},
            {
                "name": "b",
                "data": {"eval": eval_source(2)},
                "training": {"max_steps": 4},
                "continue_schedule": True,
                "frozen": [FROZEN_IN_B],
            },
        ],
    }


def scaletune_train(
    config: Path, *overrides: str, nproc: int = 1, via: str = "scaletune", fresh: bool = True
) -> subprocess.CompletedProcess:
    """`scaletune train CONFIG overrides` as a user types it (a plain command that re-executes under
    torchrun for nproc > 1), or `torchrun --nproc-per-node N -m scaletune train ...` (via="torchrun").
    `fresh=False`: the plain command's torchrun and ranks are forks of the zygote where they can be."""
    args = ["train", str(config), *overrides, f"distributed.num_processes={nproc}"]
    if via == "torchrun":
        return run_torchrun("scaletune", *args, nproc=nproc, module=True, timeout=TIMEOUT)
    # Several processes start without the test worker's OMP_NUM_THREADS (tests/conftest.py): the
    # plain command sizes it for its ranks. And fresh: the torchrun and ranks of this case start as
    # users' do, new interpreters (elsewhere they are forks of the test worker's zygote:
    # tests/forked_cli.py delegate).
    if nproc > 1:
        return run_cli(args, timeout=TIMEOUT, env={"OMP_NUM_THREADS": None}, fresh=fresh)
    return run_cli(args, timeout=TIMEOUT)


def trained(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"


def worst(got: list[float], ref: list[float]) -> float:
    return max((abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref)), default=0.0)


def agreement(run: Path, ref: Path, after: int = -1) -> dict[str, float]:
    """The worst relative difference of loss, grad_norm, lr and eval_loss between `run` and `ref`'s
    lines after step `after`, asserting both logged the same steps and evals."""
    got = [m for m in metrics(run) if m["step"] > after]
    exp = [m for m in metrics(ref) if m["step"] > after]

    def lines(ms: list[dict], key: str) -> list[tuple]:
        return [(m["step"], m["stage"]) for m in ms if key in m]

    out = {}
    for key in ("loss", "grad_norm", "lr", "eval_loss"):
        assert lines(got, key) == lines(exp, key), f"{key} lines: {lines(got, key)} vs {lines(exp, key)}"
        out[key] = worst([m[key] for m in got if key in m], [m[key] for m in exp if key in m])
    return out


@pytest.fixture(scope="module")
def edge_yaml(module_tmp_path, tiny_model_dir) -> Path:
    path = module_tmp_path / "edges.yaml"
    path.write_text(yaml.safe_dump(edge_config(tiny_model_dir, module_tmp_path / "unused")))
    return path


@pytest.fixture(scope="module")
def reference(module_tmp_path, edge_yaml) -> Path:
    """The single-process run of the edge config, shared by every case."""
    run = module_tmp_path / "single"
    trained(scaletune_train(edge_yaml, f"output_dir={run}"), "the single-process reference")
    evals = [(m["step"], m["stage"]) for m in metrics(run) if "eval_loss" in m]
    # The config does what the docstring says: step-0 eval, every 2 steps, at each stage end.
    assert evals == [(0, "a"), (2, "a"), (4, "a"), (6, "a"), (8, "b"), (10, "b")], evals
    progress = {s: json.loads((run / "checkpoints" / f"step-{s}" / "progress.json").read_text()) for s in (6, 8)}
    assert progress[STAGE_END]["stage_name"] == "a" and progress[STAGE_END]["stage_complete"] is True
    assert progress[MID_STAGE]["stage_name"] == "b" and not progress[MID_STAGE]["stage_complete"]
    lrs = [m["lr"] for m in metrics(run) if "loss" in m]
    assert lrs[6] > 0 and lrs[6] < lrs[5]  # stage b goes on down stage a's cosine (no new warmup)
    return run


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def assert_lora_exports(run: Path, control: Path, out: Path, what: str, *, merge: bool = False) -> None:
    """`run`'s LoRA export checked by content against `control` (the single-process run; itself for
    that run): final/'s adapter has the control's tensor names and shapes (peft's for the base
    model), every `lora_B` (zero at initialisation) trained; `scaletune export` of the run's last
    checkpoint, in another process, gives the same tensors bit for bit; the adapter computes the
    control's logits within the parity bound; with `merge`, `--merge-lora` computes base + adapter
    within 1e-5."""
    written, expected = adapter(run / "final"), adapter(control / "final")
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in expected.items()}, what
    assert all(v.numel() > 0 for v in written.values()), what
    lora_b = [v for k, v in written.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b), f"{what}: lora_B still zero, the adapter was not trained"

    last = max((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert last.name == "step-10", f"{what}: the last checkpoint is {last.name}, not the final step's"
    proc = run_cli(["export", str(last), "-o", str(out / "from-checkpoint")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = adapter(out / "from-checkpoint")
    assert again.keys() == written.keys(), what
    card = (out / "from-checkpoint" / "README.md").read_text()  # the adapter's card, loaded as an adapter
    assert "library_name: peft" in card and "AutoPeftModelForCausalLM.from_pretrained" in card, what
    for k in written:
        assert torch.equal(again[k], written[k]), f"{what}: {k} differs between final/ and the checkpoint's export"

    want = logits(run / "final", adapter=True)
    if run != control:
        assert_same_logits(want, logits(control / "final", adapter=True), what)
    if not merge:
        return

    proc = run_cli(["export", str(run), "-o", str(out / "merged"), "--merge-lora"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "merged" / "adapter_config.json").exists()
    assert "(the LoRA adapter merged into the base weights)" in (out / "merged" / "README.md").read_text(), what
    got = logits(out / "merged")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"{what} merged: max {(got - want).abs().max():.2e}"


def frozen_adapters(run: Path) -> dict:
    """Layer 0's adapter tensors in the run's exported adapter, by name."""
    return {k: v for k, v in adapter(run / "final").items() if ".layers.0." in k}


def test_the_single_process_adapter_exports_and_merges(module_tmp_path, reference):
    """The control's own LoRA export (final/, the checkpoint's export, the merge)."""
    assert_lora_exports(reference, reference, module_tmp_path / "single-exports", "single process", merge=True)


def cells(world: int) -> list[tuple[int, int, float]]:
    """The two resumes of a run on `world` processes: (checkpoint step, world size it resumes on,
    the bound its steps keep to the single process)."""
    same = SAME_WORLD[world]
    return [(same, world, REL), (OTHER_STEP[same], OTHER_WORLD[world], RESHARD_REL)]


def run_args(edge_yaml: Path, out: Path, strategy: str, world: int, resume: Path | None = None) -> list[str]:
    """The command line (after `scaletune`) of a case's run, or of its resume from `resume`."""
    args = ["train", str(edge_yaml), f"output_dir={out}", *STRATEGIES[strategy], f"distributed.num_processes={world}"]
    return args + ([f"training.resume={resume}"] if resume is not None else [])


@dataclass
class Case:
    """What a (strategy, world size) case left: its run and output, and each resume's (by
    (checkpoint step, world size resumed on))."""

    run: Path
    said: str
    resumed: dict[tuple[int, int], tuple[Path, str]] = field(default_factory=dict)


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step}"


@pytest.fixture(scope="module")
def driven(module_tmp_path, edge_yaml) -> dict[tuple[str, int], Case]:
    """The nine cases of :data:`DRIVEN`, each run and resume the command line a user types, in
    three torchruns: the runs at world size 2; the runs at 3 and every resume onto 3; every resume
    onto 2."""
    root = module_tmp_path / "driven"
    runs = {(strategy, world): root / f"{strategy}-{world}" for strategy, world in DRIVEN}
    resumes = {
        (case, step, on): root / f"{case[0]}-{case[1]}-from-{step}-on-{on}"
        for case in DRIVEN
        for step, on, _ in cells(case[1])
    }
    phases: dict[str, tuple[int, dict[str, list[str]]]] = {"runs-2": (2, {}), "runs-3": (3, {}), "resumes-2": (2, {})}
    for (strategy, world), out in runs.items():
        phases[f"runs-{world}"][1][out.name] = run_args(edge_yaml, out, strategy, world)
    for (case, step, on), out in resumes.items():
        phase = "runs-3" if on == 3 else "resumes-2"
        phases[phase][1][out.name] = run_args(edge_yaml, out, case[0], on, checkpoint(runs[case], step))
    said: dict[str, str] = {}
    for name, (nproc, jobs) in phases.items():
        said |= train_sequentially(jobs, root / f"{name}-logs", nproc=nproc, timeout=TIMEOUT * len(jobs))
    cases = {case: Case(out, said[out.name]) for case, out in runs.items()}
    for (case, step, on), out in resumes.items():
        cases[case].resumed[(step, on)] = (out, said[out.name])
    return cases


def by_command(edge_yaml: Path, root: Path, strategy: str, world: int) -> Case:
    """A case of :data:`USER_CASES`: the run through the plain command, then its two resumes."""
    run = root / f"{strategy}-{world}"
    proc = scaletune_train(edge_yaml, f"output_dir={run}", *STRATEGIES[strategy], nproc=world)
    trained(proc, f"{strategy} at world size {world}")
    # The plain command gives each CPU rank its share of the cores it may use (torchrun would give 1).
    threads = max(1, len(os.sched_getaffinity(0)) // world)
    assert f"starting {world} processes: OMP_NUM_THREADS={threads} " in proc.stderr, proc.stderr[-3000:]
    assert f"CPU threads: {threads} per rank (OMP_NUM_THREADS: " in proc.stderr
    case = Case(run, proc.stdout + proc.stderr)
    for (step, on, _), via in zip(cells(world), (USER_CASES[(strategy, world)], "torchrun")):
        out = root / f"{strategy}-{world}-from-{step}-on-{on}"
        resume = f"training.resume={checkpoint(run, step)}"
        # fresh=False: a new interpreter's start is the run's (above) to prove; ~40 CPU-s of imports
        proc = scaletune_train(
            edge_yaml, f"output_dir={out}", resume, *STRATEGIES[strategy], nproc=on, via=via, fresh=False
        )
        trained(proc, f"{strategy} x{world} resumed from step {step} on {on} ({via})")
        case.resumed[(step, on)] = (out, proc.stdout + proc.stderr)
    return case


@pytest.mark.parametrize(("strategy", "world"), CASES)
def test_edges_match_the_single_process(strategy, world, module_tmp_path, edge_yaml, reference, request):
    """Every logged step and eval of the run equals the single process within 1e-5, the sample
    answers too. At world size 2 its LoRA export is checked by content (:func:`assert_lora_exports`).
    Its two resumes (at stage a's end and inside stage b; one on this world size, one on
    the other) go on exactly as the single process did, and the adapters stage b freezes end
    bit-identical to this run's."""
    if (strategy, world) in USER_CASES:
        case = by_command(edge_yaml, module_tmp_path, strategy, world)
    else:
        case = request.getfixturevalue("driven")[(strategy, world)]
    run = case.run
    if strategy.startswith("zero"):  # DeepSpeed's CPU shared-memory all-reduce is neither built nor loaded
        assert "shm_comm" not in case.said, case.said[-3000:]
    for phase in ("sample answers before training", "sample answers after training"):  # counted, not silent
        assert f"[scaletune] {phase}: " in case.said, phase
    full = agreement(run, reference)
    samples, expected = ([json.loads(line) for line in (r / "samples.jsonl").open()] for r in (run, reference))
    assert samples == expected and all("trained" in s for s in samples)
    frozen = frozen_adapters(run)
    assert len(frozen) >= 2 and any(bool(t.any()) for k, t in frozen.items() if "lora_B" in k), (
        "stage a trained layer 0"
    )

    if world == 2:  # LoRA out of every engine (each engine has one case at world size 2)
        assert_lora_exports(run, reference, module_tmp_path / f"{strategy}-{world}-exports", f"{strategy} x2")

    report = {}
    for step, on, rel in cells(world):
        out, said = case.resumed[(step, on)]
        name = f"step {step} on {on}"
        assert min(m["step"] for m in metrics(out)) == step + 1, name
        if step == STAGE_END:
            assert "resumed at the end of stage a (step 6): stage b starts, its schedule continued" in said, said[
                -3000:
            ]
        if on != world:
            assert f"resharded step-{step}: written by {world} rank(s)" in said, said[-3000:]
        else:
            assert f"resumed from {checkpoint(run, step)}" in said, said[-3000:]
        report[name] = agreement(out, reference, after=step)
        got = frozen_adapters(out)
        assert got.keys() == frozen.keys()
        for key, tensor in frozen.items():
            assert torch.equal(got[key], tensor), f"{strategy} x{world} -> {name}: frozen {key} changed"
        for key, diff in report[name].items():
            assert diff <= rel, f"{strategy} x{world} resumed from {name}: {key} differs by {diff:.2e} relative"
    print(f"\n[edge] {strategy} x{world}: worst relative difference: {json.dumps(full)}; resumed: {json.dumps(report)}")
    for key, diff in full.items():
        assert diff <= REL, f"{strategy} x{world}: {key} differs by {diff:.2e} relative"


def test_data_smaller_than_one_global_batch_exits_2_once(module_tmp_path, edge_yaml):
    """8 training rows for a global batch of 12, asked of 3 processes: the parent says so in one
    error (a line for each stage) and exits 2 before any rank starts, without a traceback."""
    proc = scaletune_train(
        edge_yaml,
        f"output_dir={module_tmp_path / 'small'}",
        "data.train.max_samples=10",
        "distributed.strategy=ddp",
        nproc=3,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count("error: cannot start training") == 1, out[-3000:]
    assert out.count("stage a: 8 training sequences are fewer than one global batch (12)") == 1, out[-3000:]
    assert "Traceback" not in out and "starting 3 processes" not in out, out[-3000:]


def test_data_smaller_than_one_global_batch_under_torchrun_names_it_once(module_tmp_path, edge_yaml):
    """The same data under `torchrun --nproc-per-node 3 -m scaletune train`: every rank meets the
    problem; local rank 0 lists it, another rank that gets that far says one line (it used to be
    listed three times), and the ranks exit 2 without a traceback of scaletune's. How many others
    get that far is timing: torchrun stops them as soon as one rank exits (the one line itself:
    tests/unit/test_errors.py)."""
    proc = scaletune_train(
        edge_yaml,
        f"output_dir={module_tmp_path / 'small-torchrun'}",
        "data.train.max_samples=10",
        "distributed.strategy=ddp",
        nproc=3,
        via="torchrun",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert out.count("error: cannot start training") == 1, out[-3000:]
    assert out.count("stage a: 8 training sequences are fewer than one global batch (12)") == 1, out[-3000:]
    assert out.count("the problems are listed by local rank 0") <= 2, out[-3000:]
    # torchrun's own report (a traceback of torch.distributed.run ending in ChildFailedError)
    # names the exit code; no frame of scaletune is printed.
    assert "exitcode  : 2" in out and "src/scaletune/" not in out, out[-3000:]


DIGITS = REPO_ROOT / "examples" / "digits" / "digits.yaml"


def test_factory_model_across_two_processes(module_tmp_path, tiny_model_dir):
    """examples/digits (your own model and data) started as `scaletune train digits.yaml
    distributed.strategy=ddp distributed.num_processes=2` trains (the preflight tokenises with the
    factory's own tokenizer) and its two steps and its eval of 65 held-out images (uneven over two
    ranks of 16-image micro-batches) equal the single-process run's. Its language model is the
    session's tiny OLMo-2 (the factory's `lm_path`), and its torchrun and ranks forks of the zygote:
    the fresh plain command is the ZeRO-3 user case's."""
    common = ["stages=[{name: all, training: {max_steps: 2}}]", "data.factory_kwargs.holdout=65"]
    common += [f"model.factory_kwargs={{lm_path: {tiny_model_dir}}}"]
    common += ["training.log_every=1", "training.warmup_steps=1"]
    runs = {}
    for nproc, strategy in ((1, "single"), (2, "ddp")):
        runs[nproc] = module_tmp_path / f"digits-{nproc}"
        over = [f"output_dir={runs[nproc]}", *common, f"distributed.strategy={strategy}"]
        trained(scaletune_train(DIGITS, *over, nproc=nproc, fresh=False), f"digits x{nproc}")
    diffs = agreement(runs[2], runs[1])
    print(f"\n[edge] digits ddp x2: worst relative difference {json.dumps(diffs)}")
    assert [m["step"] for m in metrics(runs[2]) if "eval_loss" in m] == [2]
    assert all(d <= REL for d in diffs.values()), diffs

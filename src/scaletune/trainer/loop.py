"""The training loop as one object (torchtitan's `Trainer`, torchtune's recipes): load, build the
stages' data, wrap and resume, then per stage optimizer steps with evaluation, checkpoints and
metrics, then export. Each piece of state has one owner: the learning-rate schedule
(`schedule.Schedule`), the position (`position.Position`), the throughput of logged steps
(`metrics.ThroughputWindow`), what trains per stage (`model_setup.StageFreezing`), where the model
comes from (`model_source.ModelSource`), and a resumed run's hand-off (`Resumed`, taken once).

The loop never branches on the engine (it calls `strategies.protocol.LoopStrategy`). One optimizer
step consumes one global batch of `global_batch_size` sequences; its loss is the mean token loss
over every target token of that global batch on all ranks, so a step is the same computation on 1
or 64 ranks and with any micro-batch split (Hugging Face's `num_items_in_batch` normalisation,
transformers#34191, done across ranks).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scaletune.checkpoint import Progress, check_shapes, latest_checkpoint, load_rng, read_progress, save_checkpoint
from scaletune.checkpoint.resume import read_scheduler_state
from scaletune.checkpoint.save import single_process_dcp
from scaletune.data import trained_chat_template
from scaletune.env import print0, set_rank
from scaletune.errors import UserError
from scaletune.inference import samples
from scaletune.inference.progress import PhaseProgress, tracked
from scaletune.report import RunStopped, reporter, stop_agreed
from scaletune.resolve import RunSpec
from scaletune.strategies import make_strategy, torn_down
from scaletune.strategies.memory import peak_device_bytes
from scaletune.trainer.handoff import OpenRunDirectory, Prepared, Resumed, RunDirectory
from scaletune.trainer.metrics import (
    RunLogger,
    ThroughputWindow,
    host_values,
    plot_losses,
    rank_resources,
    read_metrics,
    report_memory,
    truncate_metrics,
)
from scaletune.trainer.model_setup import StageFreezing
from scaletune.trainer.model_source import model_source
from scaletune.trainer.objectives import StageObjectives
from scaletune.trainer.position import Position
from scaletune.trainer.schedule import Schedule
from scaletune.trainer.stages import StagePlan, plan_stages, stage_loaders
from scaletune.trainer.step import DivergenceError, StepResult, evaluate, seed_everything, train_step
from scaletune.trainer.tracking import Outcome

__all__ = ["Prepared", "Resumed", "RunDirectory", "Trainer"]


class Trainer:
    """Trains one resolved run as this rank.

    Args:
        spec: the resolved run (:func:`scaletune.run.prepare`).
        predicted_memory: the planner's entry for this run's strategy (`plan.json`), or None.
        open_run_dir: opens the run directory (`scaletune.run.rundir.opened`; `run.entry.train` passes it).
    """

    #: What `fit` prepared (set before the model is wrapped) and the metrics logger (set once the
    #: run directory is open): every stage runs with both.
    prepared: Prepared
    logger: RunLogger

    def __init__(self, spec: RunSpec, *, predicted_memory: dict | None = None, open_run_dir: OpenRunDirectory) -> None:
        self.spec = spec
        self.env = spec.env
        self.cfg = spec.config
        self.strategy = make_strategy(spec)
        self.predicted_memory = predicted_memory
        self.open_run_dir = open_run_dir
        self.source = model_source(spec)
        self.kind = self.source.kind  # a stage's objective may replace it (`enter_stage`)
        self.preference = StageObjectives(spec, steps_done=lambda: self.position.step)
        self.schedule = Schedule()
        self.position = Position()
        self.start_time = time.perf_counter()
        self.resumed: Resumed | None = None  # until the stage it resumes in takes it
        self.units_checked = False  # a factory module's own count compared once, at the first step
        self.memory_reported = False  # memory.json once, after the first step of the planned stage
        self.log = logging.getLogger(__name__)

    # -- the run ---------------------------------------------------------------------------
    def fit(self) -> Path:
        """Load, build data, train every stage, export `final/`. Returns the run directory.

        Raises:
            UserError: data that cannot make one global batch, a checkpoint that cannot resume.
            DivergenceError: the loss or gradient norm became NaN or infinite.
        """
        set_rank(self.env.rank)
        with torn_down(self.strategy):
            print0(f"[scaletune] {self.env.describe()}")
            print0(f"[scaletune] {self.strategy.describe()} ({self.spec.reason})")
            print0(f"[scaletune] {self.spec.batch.describe()}")
            progress = self.read_resume()
            base_answers = self.sample_base()
            model, self.prepared = self.load_model_and_data()
            with self.open_run_dir(self.spec) as run_dir:
                samples.record_base(self.spec, base_answers)
                self.strategy.barrier()
                with run_dir.checking():  # a replaced run is deleted only once this passes
                    self.wrap(model, progress)
                self.logger = RunLogger(self.spec.run_dir, self.env, self.cfg)
                outcome: Outcome = "failed"
                try:
                    for plan in self.prepared.plans:
                        self.report("phase", phase="training", stage=plan.stage.name)
                        self.run_stage(plan)
                    self.report("phase", phase="exporting")
                    self.export()
                    self.sample_trained(base_answers)
                    outcome = "finished"
                except RunStopped:  # checkpoint saved, no export: resumable, not finished
                    outcome = "stopped"
                    self.report("stopped on request", step=self.position.step)
                finally:
                    self.logger.close(outcome)
                self.strategy.barrier()
        return self.spec.run_dir

    # -- before the stages -----------------------------------------------------------------
    def load_model_and_data(self) -> tuple[torch.nn.Module, Prepared]:
        """A Hugging Face model: tokenizer, every stage's data (bad data fails before the model
        loads), then the model, seeded. A factory's model first: its data factory is handed the
        tokenizer or processor the model factory returns. Then what trains in each stage."""
        source, strategy = self.source, self.strategy
        vision = None  # a vision-language model's processor
        if source.model_first:
            seed_everything(self.cfg.seed)
            self.report("phase", phase="loading model")
            model, processor = source.load(strategy)
            tokenizer = source.tokenizer()
            tokenizer = processor if processor is not None else tokenizer
            self.report("phase", phase="loading data")
            plans = plan_stages(self.spec, tokenizer, strategy)
        else:
            self.report("phase", phase="loading data")
            tokenizer, vision = source.tokenizer(), source.processor()
            plans = plan_stages(self.spec, tokenizer, strategy, processor=vision)
            seed_everything(self.cfg.seed)
            self.report("phase", phase="loading model")
            model, _ = source.load(strategy)
        return model, Prepared(tokenizer, plans, StageFreezing(self.spec, model, source.prefix), vision)

    def report(self, kind: str, **data: Any) -> None:
        """A phase, checkpoint or stop (`kind`: a `report.EventKind` or its words, "saved checkpoint"):
        its log line (`report.event_line`) and, from the main rank, a post to `scaletune serve`."""
        from scaletune.report import EventKind, event_line

        event = EventKind.named(kind)
        print0(event_line(event, data))
        if self.env.is_main:
            reporter().add(event, data, flush=True)

    def read_resume(self) -> Progress | None:
        path = self.spec.resume_from
        if path is None and self.cfg.training.resume == "auto":
            where = self.spec.run_dir / "checkpoints"
            print0(f"[scaletune] training.resume auto: no checkpoint in {where}, starting fresh")
        return read_progress(path) if path is not None else None

    def wrap(self, model: torch.nn.Module, progress: Progress | None) -> None:
        """Hand the model and its loss to the engine; resume model, optimizer and position."""
        if progress is not None:
            self.strategy.prepare_resume(self.spec.resume_from, progress.world_size)
        loss = self.source.loss(model, self.strategy)
        if self.preference.any:
            loss = self.preference.loss_module(loss)
        self.prepared.freezing.before_wrap(loss, self.strategy, progress.stage_index if progress is not None else 0)
        self.strategy.wrap(loss)
        self.preference.after_wrap(self.strategy, self.source)
        if progress is not None:
            self.resume(progress)

    def resume(self, progress: Progress) -> None:
        """Load model and optimizer state from the checkpoint; say what was resharded."""
        path, strategy = self.spec.resume_from, self.strategy
        assert path is not None
        if progress.checkpoint_format != strategy.checkpoint_format:
            raise UserError(
                f"{path} was written by strategy {progress.strategy} ({progress.checkpoint_format} format) and "
                f"cannot resume under {strategy.name}; export it (scaletune export) and fine-tune from the export",
                title="cannot resume",
            )
        if progress.checkpoint_format == "dcp":
            check_shapes(path, strategy.state_shapes())
        with single_process_dcp():
            strategy.load_state(path)
        self.position.step = progress.step
        self.resumed = Resumed(path, progress, read_scheduler_state(path))
        if self.env.is_main:
            from scaletune.rollout.rollout import ROLLOUTS, truncate_rollouts

            truncate_metrics(self.spec.run_dir / "metrics.jsonl", progress.step)
            truncate_rollouts(self.spec.run_dir / ROLLOUTS, progress.step)
        if progress.world_size != self.env.world_size:
            dcp = progress.checkpoint_format == "dcp"
            how = "torch.distributed.checkpoint" if dcp else "DeepSpeed's universal checkpoint"
            print0(
                f"[scaletune] resharded {path.name}: written by {progress.world_size} rank(s) ({progress.strategy}), "
                f"now {self.env.world_size}; model and optimizer state re-split by {how}, "
                f"data resumes at sample {progress.sample_offset} of epoch {progress.epoch}"
            )
        else:
            print0(f"[scaletune] resumed from {path} at step {progress.step} (stage {progress.stage_name})")

    # -- a stage ---------------------------------------------------------------------------
    def run_stage(self, plan: StagePlan) -> None:
        """The optimizer steps of one stage, from the resumed position when the run resumes in it."""
        if self.finished_before_checkpoint(plan):
            return
        batches, eval_loader = self.enter_stage(plan)
        window = ThroughputWindow()
        for epoch, i, micro in self.preference.generations(batches, lambda: plan.total - self.position.stage_step):
            if self.position.stage_step >= plan.total:
                break
            lr = self.strategy.lr()
            result = train_step(self.strategy, micro, self.kind, check_units=not self.units_checked)
            self.units_checked = True
            self.schedule.step()  # after the optimizer's step, as LambdaLR expects
            self.position.advance(epoch, i)
            self.after_step(plan, lr, result, eval_loader, window)

    def finished_before_checkpoint(self, plan: StagePlan) -> bool:
        """True for a stage a resumed run's checkpoint is past (or finished, if it is the last)."""
        if self.resumed is None:
            return False
        start, index = self.resumed.progress, plan.stage.index
        if start.stage_index < index or (start.stage_index == index and start.stage_step < plan.total):
            return False
        if start.stage_index == index and index == self.prepared.plans[-1].stage.index:
            print0(
                f"[scaletune] the checkpoint finished stage {plan.stage.name} ({start.stage_step} of {plan.total} steps): nothing to train"
            )
        return True

    def take_resumed(self, stage_index: int) -> tuple[Resumed | None, Resumed | None]:
        """The resume hand-off, taken by the first stage entered: (inside, boundary). `inside`: the
        run resumes in this stage; `boundary`: the checkpoint ended the stage before it (a
        stage-end checkpoint), whose RNG and continuing schedule this stage starts from."""
        resumed, self.resumed = self.resumed, None
        if resumed is None:
            return None, None
        if resumed.progress.stage_index == stage_index:
            return resumed, None
        return None, resumed  # also a mid-stage checkpoint of a stage since shortened to its step

    def enter_stage(self, plan: StagePlan) -> tuple[Iterator, Any]:
        """Loaders (from the resumed position), what trains, the schedule, the position, the
        evaluation before training. Returns (global batches, the eval loader or None)."""
        stage, prepared = plan.stage, self.prepared
        self.logger.objective(stage.training.objective)
        resumed, boundary = self.take_resumed(stage.index)
        if boundary is not None:
            # The uninterrupted run enters this stage right after saving that checkpoint: from its RNG.
            load_rng(boundary.path, self.env.rank)
            print0(
                f"[scaletune] resumed at the end of stage {boundary.progress.stage_name} (step {boundary.progress.step}): "
                f"stage {stage.name} starts{', its schedule continued' if plan.schedule_origin != stage.index else ''}"
            )
        start = resumed.progress if resumed is not None else None
        if start is not None and start.stage_complete:
            print0(
                f"[scaletune] stage {stage.name} ended at step {start.stage_step} in the checkpoint; its steps are now "
                f"{plan.total}: continuing, the learning-rate schedule stretched over {plan.schedule_steps} steps"
            )
        self.kind = self.preference.enter(
            plan, self.strategy, prepared.tokenizer, resumed is not None, self.source.kind
        )
        batches, eval_loader = stage_loaders(plan, self.spec, prepared.tokenizer, start)
        retargeted = prepared.freezing.enter(self.strategy, stage.index)
        # A continuing stage keeps the running schedule; resumed into one, it rebuilds its origin's
        # schedule and the saved state restores the position.
        origin = prepared.plans[plan.schedule_origin].stage.training
        continues = plan.schedule_origin != stage.index
        self.schedule.enter(
            self.strategy.optimizer,
            origin,
            plan.schedule_steps,
            continues=continues,
            retargeted=retargeted,
            saved=boundary.scheduler if boundary is not None else None,
        )
        self.position.enter_stage(start)
        if resumed is not None:
            self.schedule.restore(resumed.scheduler)
            load_rng(resumed.path, self.env.rank)  # after data building, right before the next step
        if eval_loader is not None and stage.training.eval_on_start and self.position.step == 0:
            self.log_eval(plan, eval_loader)
        self.strategy.train_mode(True)
        self.logger.start_progress(plan.total, stage.name, completed=self.position.stage_step)
        return batches, eval_loader

    def after_step(
        self, plan: StagePlan, lr: float, result: StepResult, eval_loader: Any, window: ThroughputWindow
    ) -> None:
        """Memory report, metrics, evaluation, checkpoint and a requested stop, as the stage's
        settings say."""
        stage, position = plan.stage, self.position
        if not self.memory_reported and stage.index >= (self.prepared.freezing.peak or 0):
            self.report_memory()  # in the stage the plan is for
        window.add(result.tokens)  # summed on the device, read when the step is logged
        last = position.stage_step == plan.total
        t = stage.training
        # `scaletune serve` asked to stop. At every step, not only logged ones, so a stop comes at
        # the next step whatever log_every is (the next generation's end, when one trains several
        # steps); a run serve does not watch reads nothing here, a watched one with several ranks
        # pays one small all-reduce and its read per step.
        sampled = self.preference.generation_start(position.step)  # None: inside a generation
        stop = not last and sampled is not None and stop_agreed(self.strategy.all_reduce_sum)
        # A save_every multiple passed since the generation was sampled (this step, for a step a generation).
        due = bool(t.save_every) and sampled is not None and position.step // t.save_every != sampled // t.save_every
        will_save = last or stop or due
        if position.stage_step % t.log_every == 0 or last or will_save:
            self.log_step(plan, lr, result, window)
        if eval_loader is not None and ((t.eval_every and position.stage_step % t.eval_every == 0) or last):
            self.log_eval(plan, eval_loader)
        if will_save:
            self.save(plan, last)
        if stop:
            raise RunStopped()

    # -- what a step leaves ----------------------------------------------------------------
    def log_eval(self, plan: StagePlan, eval_loader: Any) -> None:
        """One metrics.jsonl line with the eval loss at the current step (step 0: before training)."""
        with PhaseProgress(f"eval at step {self.position.step}", len(eval_loader), "micro-batches") as progress:
            loss, stats = evaluate(self.strategy, tracked(eval_loader, progress), self.kind)
        elapsed = round(time.perf_counter() - self.start_time, 3)
        extra = {f"eval_{k}": v for k, v in self.preference.metrics(stats).items()}
        self.logger.log(
            {"step": self.position.step, "stage": plan.stage.name, "eval_loss": loss, **extra, "elapsed_s": elapsed}
        )

    def log_step(self, plan: StagePlan, lr: float, result: StepResult, window: ThroughputWindow) -> None:
        """One metrics.jsonl line; a non-finite loss or gradient norm stops the run (no checkpoint of
        it), as does an online engine's log-probs disagreeing with the trainer's (`check_engine`).

        Everything read from the device or NVML is read here, on logged steps only (`after_step`):
        between them a step leaves its values on the device and reads nothing.
        """
        # One device-to-host read for all the step's values (at log_every 1, the step's only sync
        # on one rank; more ranks add rank_resources' all-reduce).
        loss, grad_norm, skipped, tokens, window_tokens = host_values(
            result.loss, result.grad_norm, result.skipped, result.tokens, window.tokens
        )
        now, position = time.perf_counter(), self.position
        objective_metrics = self.preference.metrics(result.stats)
        self.logger.log(
            {
                "step": position.step,
                "stage": plan.stage.name,
                "stage_step": position.stage_step,
                "epoch": position.epochs(plan.steps_per_epoch),
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                **objective_metrics,
                "tokens": int(tokens),
                "tokens_per_s": window.close(now, window_tokens),
                "elapsed_s": round(now - self.start_time, 3),
                # The page's progress bar and ETA (all stages' steps), memory per rank (a collective).
                "total_steps": sum(p.total for p in self.prepared.plans),
                **rank_resources(
                    self.strategy.all_reduce_sum,
                    self.env.world_size,
                    self.env.rank,
                    peak_device_bytes(self.strategy.memory_devices()),
                ),
                **({"skipped": True} if skipped else {}),
            }
        )
        # An fp16 step the loss scaler skipped has an infinite gradient norm by design, not divergence.
        if not (math.isfinite(loss) and (math.isfinite(grad_norm) or skipped)):
            good = latest_checkpoint(self.spec.run_dir)
            raise DivergenceError(
                f"training diverged at step {position.step}: loss {loss}, grad_norm {grad_norm}; "
                f"no checkpoint was written for it. Last good checkpoint: {good or 'none'} "
                "(lower training.learning_rate or raise warmup_steps, then resume from it)"
            )
        self.preference.check_engine(objective_metrics, position.step)

    def save(self, plan: StagePlan, last: bool) -> None:
        """`checkpoints/step-N`: engine state, the schedule, and the position of the next step."""
        self.report("phase", phase="checkpointing", step=self.position.step)
        progress = self.position.progress(
            stage_index=plan.stage.index,
            stage_name=plan.stage.name,
            steps_per_epoch=plan.steps_per_epoch,
            global_batch_size=plan.batch.global_batch_size,
            world_size=self.env.world_size,
            strategy=self.strategy.name,
            checkpoint_format=self.strategy.checkpoint_format,
            stage_complete=last,
        )
        keep = plan.stage.training.keep_last
        path = save_checkpoint(
            self.strategy, self.spec.run_dir, progress, self.cfg, self.schedule.state_dict(), keep_last=keep
        )
        self.report("saved checkpoint", step=self.position.step, path=str(path))

    def report_memory(self) -> None:
        """After the first optimizer step: `memory.json` and `plan.json` (see `metrics.report_memory`)."""
        self.memory_reported = True
        report_memory(self.strategy, self.spec, self.predicted_memory, self.preference.rollout_memory())

    # -- around training -------------------------------------------------------------------
    def sample_base(self) -> list[str] | None:
        """Rank 0 alone (`loading_alone`): the untrained model answers `training.sample_prompts`."""
        with self.strategy.loading_alone():
            return samples.before_training(self.spec)

    def sample_trained(self, base: list[str] | None) -> None:
        """Rank 0 alone: `final/` answers them too; both answers go to samples.md and the terminal.
        Then `final/`'s model card, with those answers (in place of peft's template card, which
        names the base by its path on this machine)."""
        with self.strategy.loading_alone():
            samples.after_training(self.spec, base)
        if self.env.is_main and not self.spec.custom_model:  # a factory's final/ is its own folder
            from scaletune.checkpoint.card import model_card

            kind = "adapter" if self.cfg.model.lora is not None else "model"
            card = model_card(
                self.cfg,
                source="The run's own `final/`",
                run_dir=self.spec.run_dir,
                step=self.position.step,
                kind=kind,
                folder="final",
            )
            (self.spec.run_dir / "final" / "README.md").write_text(card)

    def export(self) -> None:
        """`final/`: the model (or adapter) and tokenizer; `loss.png` from the whole metrics file."""
        final = self.spec.run_dir / "final"
        self.strategy.export(final, self.prepared.freezing.trained_base)
        if self.env.is_main:
            tokenizer = self.prepared.tokenizer
            if self.prepared.processor is not None:  # a vision-language model: its tokenizer with it
                self.prepared.processor.save_pretrained(str(final))
            elif hasattr(tokenizer, "save_pretrained"):
                template = trained_chat_template((st.data for st in self.spec.stages), tokenizer)
                if template is not None:
                    tokenizer.chat_template = template
                tokenizer.save_pretrained(str(final))
            # From the file, not this process's records: a resumed run plots the whole curve.
            plot_losses(read_metrics(self.spec.run_dir / "metrics.jsonl"), self.spec.run_dir / "loss.png")
            self.log.info(f"saved {final}")

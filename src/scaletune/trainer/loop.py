"""The training loop as one object (torchtitan's `Trainer`, torchtune's recipes): it owns the
strategy, the logger and the run's state, and runs in small named steps: load, build the stages'
data, wrap and resume, then per stage optimizer steps with evaluation, checkpoints and metrics,
then export.

The loop is the same for every strategy: it never branches on the engine (strategies/base.py).
One optimizer step consumes one global batch of `global_batch_size` sequences; its loss is the
mean token loss over every target token of that global batch on all ranks, so a step is the same
computation on 1 or 64 ranks and with any micro-batch split (Hugging Face's `num_items_in_batch`
normalisation, transformers#34191, done across ranks).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scaletune.checkpoint import Progress, check_shapes, latest_checkpoint, load_rng, read_progress, save_checkpoint
from scaletune.checkpoint.save import single_process_dcp
from scaletune.env import get_logger, print0, set_rank
from scaletune.errors import UserError
from scaletune.inference import samples
from scaletune.report import RunStopped, reporter, stop_agreed
from scaletune.resolve import RunSpec
from scaletune.run.rundir import opened as opened_run_dir
from scaletune.strategies import make_strategy
from scaletune.strategies.base import torn_down
from scaletune.strategies.optim import make_scheduler
from scaletune.trainer.batches import batch_kind
from scaletune.trainer.metrics import RunLogger, plot_losses, read_metrics, report_memory, truncate_metrics
from scaletune.trainer.model_setup import StageFreezing, loss_module
from scaletune.trainer.stages import StagePlan, plan_stages, stage_loaders
from scaletune.trainer.step import DivergenceError, StepResult, evaluate, seed_everything, train_step

__all__ = ["Trainer"]


@dataclass
class RunState:
    step: int = 0  # optimizer steps since the run began
    start_time: float = field(default_factory=time.perf_counter)
    resume: Progress | None = None  # where a resumed run continues
    resume_scheduler: dict | None = None
    memory_reported: bool = False
    units_checked: bool = False


class Trainer:
    """Trains one resolved run as this rank.

    Args:
        spec: the resolved run (:func:`scaletune.run.prepare`).
        predicted_memory: the planner's entry for this run's strategy (`plan.json`), or None.
    """

    def __init__(self, spec: RunSpec, *, predicted_memory: dict | None = None) -> None:
        self.spec = spec
        self.env = spec.env
        self.cfg = spec.config
        self.strategy = make_strategy(spec)
        self.predicted_memory = predicted_memory
        self.state = RunState()
        self.kind = batch_kind(spec.custom_model)
        self.freezing: StageFreezing | None = None
        self.tokenizer: Any = None
        self.plans: list[StagePlan] = []
        self.logger: RunLogger | None = None
        self.log = get_logger()

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
            model = self.load_model_and_data()
            with opened_run_dir(self.spec) as run_dir:
                samples.record_base(self.spec, base_answers)
                self.strategy.barrier()
                with run_dir.checking():  # a replaced run is deleted only once this passes
                    self.wrap(model, progress)
                self.logger = RunLogger(self.spec.run_dir, self.env, self.cfg)
                try:
                    for plan in self.plans:
                        self.report("phase", phase="training", stage=plan.stage.name)
                        self.run_stage(plan)
                    self.report("phase", phase="exporting")
                    self.export()
                    self.sample_trained(base_answers)
                except RunStopped:  # checkpoint saved, no export: resumable, not finished
                    self.report("stopped on request", step=self.state.step)
                finally:
                    self.logger.close()
                self.strategy.barrier()
        return self.spec.run_dir

    # -- steps -----------------------------------------------------------------------------
    def load_model_and_data(self) -> torch.nn.Module:
        """A Hugging Face model: tokenizer, every stage's data (bad data fails before the model
        loads), then the model, seeded. A factory's model first: its data factory is handed the
        tokenizer or processor the model factory returns."""
        if self.spec.custom_model:
            seed_everything(self.cfg.seed)
            self.report("phase", phase="loading model")
            model = self.load_model()
            self.report("phase", phase="loading data")
            self.plans = plan_stages(self.spec, self.tokenizer, self.strategy)
            return model
        self.report("phase", phase="loading data")
        self.load_tokenizer()
        self.plans = plan_stages(self.spec, self.tokenizer, self.strategy)
        seed_everything(self.cfg.seed)
        self.report("phase", phase="loading model")
        return self.load_model()

    def report(self, kind: str, **data: Any) -> None:
        """A phase, checkpoint or stop (`kind`: a `report.EventKind` or its words, "saved checkpoint"):
        its log line (`report.event_line`) and, from the main rank, a post to `scaletune serve`."""
        from scaletune.report import EventKind, event_line

        event = EventKind.named(kind)
        print0(event_line(event, data))
        if self.env.is_main:
            reporter().add(event, data, flush=True)

    def load_tokenizer(self) -> None:
        from scaletune.models import load_tokenizer

        m = self.cfg.model
        self.tokenizer = load_tokenizer(m) if (m.tokenizer or not self.spec.custom_model) else None

    def read_resume(self) -> Progress | None:
        path = self.spec.resume_from
        if path is None:
            if self.cfg.training.resume == "auto":
                print0(
                    f"[scaletune] training.resume auto: no checkpoint in {self.spec.run_dir / 'checkpoints'}, starting fresh"
                )
            return None
        return read_progress(path)

    def load_model(self) -> torch.nn.Module:
        """The model (and a factory's tokenizer or processor), and what trains in each stage."""
        from scaletune.trainer.model_setup import load_model

        model, processor = load_model(self.spec, self.strategy)
        if self.spec.custom_model:
            self.load_tokenizer()
            self.tokenizer = processor if processor is not None else self.tokenizer
        self.freezing = StageFreezing(self.spec, model)
        return model

    def wrap(self, model: torch.nn.Module, progress: Progress | None) -> None:
        """Hand the model and its loss to the engine; resume model, optimizer and position."""
        if progress is not None:
            self.strategy.prepare_resume(self.spec.resume_from, progress.world_size)
        loss = loss_module(self.spec, model, self.strategy)
        assert self.freezing is not None
        self.freezing.before_wrap(loss, self.strategy, progress.stage_index if progress is not None else 0)
        self.strategy.wrap(loss)
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
        self.state.step = progress.step
        self.state.resume = progress
        self.state.resume_scheduler = json.loads((path / "scheduler.json").read_text())
        if self.env.is_main:
            truncate_metrics(self.spec.run_dir / "metrics.jsonl", self.state.step)
        if progress.world_size != self.env.world_size:
            how = (
                "torch.distributed.checkpoint"
                if progress.checkpoint_format == "dcp"
                else "DeepSpeed's universal checkpoint"
            )
            print0(
                f"[scaletune] resharded {path.name}: written by {progress.world_size} rank(s) ({progress.strategy}), "
                f"now {self.env.world_size}; model and optimizer state re-split by {how}, "
                f"data resumes at sample {progress.sample_offset} of epoch {progress.epoch}"
            )
        else:
            print0(f"[scaletune] resumed from {path} at step {progress.step} (stage {progress.stage_name})")

    def run_stage(self, plan: StagePlan) -> None:
        """The optimizer steps of one stage, from the resumed position when the run resumes in it."""
        stage, strategy, state = plan.stage, self.strategy, self.state
        start = state.resume
        if start is not None and (
            start.stage_index > stage.index or (start.stage_index == stage.index and start.stage_step >= plan.total)
        ):
            if start.stage_index == stage.index and stage.index == self.plans[-1].stage.index:
                print0(
                    f"[scaletune] the checkpoint finished stage {stage.name} ({start.stage_step} of {plan.total} steps): nothing to train"
                )
            return  # finished before the checkpoint
        resuming_here = start is not None and start.stage_index == stage.index
        if resuming_here and start.stage_complete:
            print0(
                f"[scaletune] stage {stage.name} ended at step {start.stage_step} in the checkpoint; its steps are now "
                f"{plan.total}: continuing, the learning-rate schedule stretched over {plan.schedule_steps} steps"
            )
        batches, eval_loader = stage_loaders(plan, self.spec, self.tokenizer, start if resuming_here else None)
        assert self.freezing is not None
        if self.freezing.enter(strategy, stage.index):
            self.rebuild_schedule(plan)
        if strategy.scheduler is None or plan.schedule_origin == stage.index:
            # A continuing stage keeps the running schedule; resumed into one, it rebuilds its origin's
            # schedule and the saved scheduler state restores the position.
            origin = self.plans[plan.schedule_origin].stage.training
            strategy.scheduler = make_scheduler(strategy.optimizer, origin, plan.schedule_steps)
        if resuming_here:
            assert start is not None and state.resume_scheduler is not None
            sched = strategy.scheduler
            sched.load_state_dict(state.resume_scheduler)
            # The position comes from the checkpoint, the horizon from this run's schedule (longer
            # when max_steps was raised): the next step's rate, from the schedule's own lambdas.
            for group, base, rate in zip(strategy.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                group["lr"] = base * rate(sched.last_epoch)
            load_rng(self.spec.resume_from, self.env.rank)  # after data building, right before the next step
        done = start.stage_step if resuming_here else 0
        state.resume = None
        if eval_loader is not None and stage.training.eval_on_start and state.step == 0:
            self.log_eval(plan, eval_loader)
        strategy.train_mode(True)
        assert self.logger is not None
        self.logger.start_progress(plan.total, stage.name, completed=done)
        window = [time.perf_counter(), 0.0]
        for stage_step, (epoch, i, micro) in enumerate(batches, done + 1):
            if stage_step > plan.total:
                break
            lr = strategy.lr()
            result = train_step(strategy, micro, self.kind, check_units=not state.units_checked)
            state.units_checked = True
            state.step += 1
            if not state.memory_reported and stage.index >= (self.freezing.peak or 0):
                self.report_memory()  # in the stage the plan is for
            window[1] += float(result.tokens)
            last = stage_step == plan.total
            t = stage.training
            stop = not last and stop_agreed(strategy.all_reduce_sum)  # `scaletune serve` asked to stop
            will_save = last or stop or bool(t.save_every and state.step % t.save_every == 0)
            if stage_step % t.log_every == 0 or last or will_save:
                self.log_step(plan, stage_step, epoch, i, lr, result, window)
            if eval_loader is not None and ((t.eval_every and stage_step % t.eval_every == 0) or last):
                self.log_eval(plan, eval_loader)
            if will_save:
                self.save(plan, stage_step, epoch, i, last)
            if stop:
                raise RunStopped()

    def log_eval(self, plan: StagePlan, eval_loader: Any) -> None:
        """One metrics.jsonl line with the eval loss at the current step (step 0: before training)."""
        assert self.logger is not None
        loss, elapsed = (
            evaluate(self.strategy, eval_loader, self.kind),
            round(time.perf_counter() - self.state.start_time, 3),
        )
        self.logger.log({"step": self.state.step, "stage": plan.stage.name, "eval_loss": loss, "elapsed_s": elapsed})

    def rebuild_schedule(self, plan: StagePlan) -> None:
        """After a re-target (a new optimizer): a stage that continues the running schedule gets it
        again on the new optimizer, at the same position; other stages build their own next."""
        old, strategy = self.strategy.scheduler, self.strategy
        strategy.scheduler = None
        if old is None or plan.schedule_origin == plan.stage.index:
            return
        origin = self.plans[plan.schedule_origin].stage.training
        strategy.scheduler = make_scheduler(strategy.optimizer, origin, plan.schedule_steps)
        strategy.scheduler.load_state_dict(old.state_dict())
        for group, lr in zip(strategy.optimizer.param_groups, strategy.scheduler.get_last_lr()):
            group["lr"] = lr

    def log_step(
        self, plan: StagePlan, stage_step: int, epoch: int, i: int, lr: float, result: StepResult, window: list
    ) -> None:
        """One metrics.jsonl line; a non-finite loss or gradient norm stops the run (no checkpoint of it)."""
        assert self.logger is not None
        # One device-to-host read for both (at log_every 1 this is the step's only sync).
        both = torch.stack([result.loss.float(), result.grad_norm.float().to(result.loss.device)]).tolist()
        loss, grad_norm = both[0], both[1]
        now = time.perf_counter()
        self.logger.log(
            {
                "step": self.state.step,
                "stage": plan.stage.name,
                "stage_step": stage_step,
                "epoch": round(epoch + (i + 1) / plan.steps_per_epoch, 4),
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens": int(result.tokens),
                "tokens_per_s": window[1] / max(now - window[0], 1e-9),
                "elapsed_s": round(now - self.state.start_time, 3),
                **({"skipped": True} if result.skipped else {}),
            }
        )
        window[0], window[1] = now, 0.0
        # An fp16 step the loss scaler skipped has an infinite gradient norm by design, not divergence.
        if not (math.isfinite(loss) and (math.isfinite(grad_norm) or result.skipped)):
            good = latest_checkpoint(self.spec.run_dir)
            raise DivergenceError(
                f"training diverged at step {self.state.step}: loss {loss}, grad_norm {grad_norm}; "
                f"no checkpoint was written for it. Last good checkpoint: {good or 'none'} "
                "(lower training.learning_rate or raise warmup_steps, then resume from it)"
            )

    def save(self, plan: StagePlan, stage_step: int, epoch: int, i: int, last: bool) -> None:
        self.report("phase", phase="checkpointing", step=self.state.step)
        next_epoch, next_step = (epoch, i + 1) if i + 1 < plan.steps_per_epoch else (epoch + 1, 0)
        progress = Progress(
            step=self.state.step,
            stage_index=plan.stage.index,
            stage_name=plan.stage.name,
            stage_step=stage_step,
            epoch=next_epoch,
            step_in_epoch=next_step,
            sample_offset=next_step * plan.batch.global_batch_size,
            world_size=self.env.world_size,
            strategy=self.strategy.name,
            checkpoint_format=self.strategy.checkpoint_format,
            stage_complete=last,
        )
        keep = plan.stage.training.keep_last
        path = save_checkpoint(
            self.strategy, self.spec.run_dir, progress, self.cfg, self.strategy.scheduler.state_dict(), keep_last=keep
        )
        self.report("saved checkpoint", step=self.state.step, path=str(path))

    def report_memory(self) -> None:
        """After the first optimizer step: `memory.json` and `plan.json` (see `metrics.report_memory`)."""
        self.state.memory_reported = True
        report_memory(self.strategy, self.spec, self.predicted_memory)

    def sample_base(self) -> list[str] | None:
        """Rank 0: the untrained model answers `training.sample_prompts` (before the training copy loads)."""
        return samples.before_training(self.spec)

    def sample_trained(self, base: list[str] | None) -> None:
        """Rank 0: `final/` answers them too; both answers go to samples.md and the terminal."""
        samples.after_training(self.spec, base)

    def export(self) -> None:
        """`final/`: the model (or adapter) and tokenizer; `loss.png` from the whole metrics file."""
        final = self.spec.run_dir / "final"
        self.strategy.export(final)
        if self.env.is_main:
            if hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(str(final))
            # From the file, not this process's records: a resumed run plots the whole curve.
            plot_losses(read_metrics(self.spec.run_dir / "metrics.jsonl"), self.spec.run_dir / "loss.png")
            self.log.info(f"saved {final}")

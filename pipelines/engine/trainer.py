"""The training loop: ``Trainer.fit`` reads top to bottom; nothing here is model- or launcher-specific.

``train(cfg)`` is what ``python -m pipelines.pretrain`` runs in every process: it checks the corpus
and the config *before* any process group exists, builds task, model and data sources, and hands
them to ``Trainer``. Fine-tuning builds its own model/task/sources and reuses ``Trainer`` with its ``RunHooks``:

    trainer = Trainer(cfg, model=model, task=task, train_data=MapStyleSource(...), eval_data=MapStyleSource(...))
    summary = trainer.fit()

Every rank does the same number of steps on the same number of batches; one small all-reduce per
step carries the loss, token count and the stop flags (signal, wall time), so all ranks stop and
checkpoint at the same step boundary.

The host reads a step's values (the all-reduced loss, the gradient norm, whether the update was
applied) one step late where the engine allows it (``Engine.loss_check_on_device``): it queues step
n+1 before it reads step n, so the device never waits for the host between steps. Steps that act
on their values -- log, evaluation, checkpoint and diagnostics steps, the last step, every step under
``max_tokens`` or ``logging.sample_keys`` -- read them at once (``_reads_now``). A stop that a late
read finds (signal, time budget, health) takes effect after the step already queued, the same step
on every rank. ``train.read_late=false`` reads every step at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from core.config import save_config, to_dict
from core.corpus_kinds import corpus_kind
from core.files import unlock_dir
from pipelines.engine import checkpoint as ckpt
from pipelines.engine import distributed as dist
from pipelines.engine import engines, stop_signals
from pipelines.engine.check import run_schedule
from pipelines.engine.config import RunConfig
from pipelines.engine.hooks import RunHooks
from pipelines.engine.host_reads import HostCopy, StepOutcome, loss_or_nan
from pipelines.engine.model_build import build_model, flops_per_sample, preferred_attention
from pipelines.engine.run_data import RunData, build_sources, open_run_data
from pipelines.engine.stop_signals import signal_name
from pipelines.loading.workers import register_stack_dump

__all__ = ["Trainer", "train", "build_model", "RunData", "open_run_data", "build_sources"]  # re-exported: model_build, run_data

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _RunState:
    """What ``fit`` sets up once and its steps share."""

    logger: Any
    health: Any
    meter: Any
    trace: Any
    profiler: Any  # monitoring.profiler.StepProfiler: logging.profile_steps
    resume: Path | None


@dataclasses.dataclass
class _StepResult:
    """One optimizer step as the later steps of ``fit`` see it (once its host values are read)."""

    number: int  # the step's 1-based number
    loss: float  # mean over ranks (non-finite: the step was skipped)
    agg: dict[str, Any]  # the all-reduced sums and stop flags (``_agreement``)
    result: dict[str, Any]  # ``Engine.step`` / ``skip_step``: grad_norm, lr, skipped (+ loss_scale)
    rates: dict[str, float]  # throughput / MFU / data wait of this step


@dataclasses.dataclass
class _QueuedStep:
    """An optimizer step whose work is queued on the device; ``read`` gets its host values."""

    number: int
    agreement: HostCopy | list[float]  # summed over ranks: loss, tokens, bad samples, signal, time up
    outcome: StepOutcome
    peer_wait: float
    rates: dict[str, float] = dataclasses.field(default_factory=dict)  # filled when the step ends (the same dict)
    read_result: _StepResult | None = None

    def read(self, world_size: int) -> _StepResult:
        """The host values (waits for the device to finish this step, if it has not)."""
        if self.read_result is None:
            loss, tokens, bad, signal_sum, time_up = self.agreement if isinstance(self.agreement, list) else self.agreement.tolist()
            agg = {"loss": loss / world_size, "tokens": int(tokens), "bad": int(bad), "signal": signal_sum > 0,
                   "time_up": time_up > 0}
            result = self.outcome.get()
            if not math.isfinite(agg["loss"]):  # its gradients were NaN by construction, not measured: no norm
                result = {**result, "grad_norm": None}
            self.read_result = _StepResult(self.number, agg["loss"], agg, result, self.rates)
        return self.read_result


class Trainer:
    """Runs ``cfg.train`` over ``train_data`` with ``task`` on ``model`` (see module docstring).

    ``train_data`` / ``eval_data``: objects with ``batches(limit=None)`` (an iterator that advances a
    position), ``state_dict()``, ``load_state_dict()``, ``batches_per_epoch`` and
    ``evaluation_batches(limit=None)`` (one pass over the split: ``(batch, counted)``) —
    ``data.StreamingSource`` and ``data.MapStyleSource`` are the two provided.
    """

    def __init__(self, cfg: RunConfig, *, model: torch.nn.Module, task: Any, train_data: Any, eval_data: Any = None,
                 env: dist.DistEnv | None = None, tokenizer_dir: Path | None = None,
                 model_build: dict[str, Any] | None = None, data_info: dict[str, Any] | None = None,
                 hooks: RunHooks | None = None):
        from pipelines.engine.optim import build_optimizer

        self.cfg, self.task, self.train_data, self.eval_data = cfg, task, train_data, eval_data
        self.hooks = hooks or RunHooks()
        self.env = env or dist.init_env()
        dist.validate(cfg, self.env)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.tokenizer_dir, self.data_info = tokenizer_dir, data_info or {}
        self.model_build = model_build or {"name": cfg.model.name, "overrides": dict(cfg.model.overrides)}
        self.model_config = getattr(model, "config", None)
        offload = cfg.distributed.engine == "deepspeed" and cfg.distributed.offload_optimizer
        optimizer = build_optimizer(model, cfg.optim, offload=offload, device=self.env.device)  # before prepare() moves it
        self.param_shapes = ckpt.param_shapes(model)  # before ZeRO-3 partitions them: what a resume must match
        schedule = run_schedule(cfg, d_model=getattr(self.model_config, "hidden_size", 0))
        self.engine = engines.build_engine(cfg, self.env, model, optimizer, schedule)
        self.is_main = self.engine.rank == 0
        self.run_dir = Path(cfg.train.run_dir)
        self.step = self.tokens = 0
        self.last_good_step = 0  # the newest step whose update was applied (or the resumed step)
        self.health_stop_step: int | None = None  # the step whose values stopped the run (health)
        self.start_loss: float | None = None
        self.last_eval: dict[str, float] = {}
        self._signal: int | None = None  # the stop signal this process received (``stop_signals``)
        self._restore_sigint: Any = lambda: None
        self._run_lock: int | None = None  # rank 0's lock on run_dir while fit() runs
        self._started = time.time()  # when the run would have started, had it trained without a break (``_start``)

    # ------------------------------------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps`` (or a budget, a signal, a health stop, early stopping); return a summary."""
        try:
            self._run_lock, resume = ckpt.open_for_resume(self.engine, self.run_dir, self.cfg.train, self.param_shapes)
            if resume is not None and resume.finished:  # agreed: every rank returns
                return self._nothing_to_do(resume)
            run = self._start(resume.path if resume else None)
            batches = self.train_data.batches()
            self.engine.train()
            stop_reason, last_saved, queued = None, None, []
            while self.step < self.cfg.train.max_steps:
                read_now = self._reads_now(self.step + 1, run)
                run.profiler.before(self.step + 1)
                queued.append(self._train_step(batches, run, read_now))
                run.profiler.after(self.step)
                stop_reason = self._finish_steps(queued, run, keep_newest=not read_now)
                stop_reason = self._maybe_eval(stop_reason, run)
                last_saved, finished = self._maybe_checkpoint(stop_reason, run, last_saved)
                if finished:
                    break
            if stop_reason in (None, "max_tokens", "max_time"):  # the end of the run: final evaluation and checkpoint
                if self.eval_data is not None:
                    self.last_eval = self.evaluate()
                    run.logger.log(self.step, self.last_eval, split="eval")
                    self.hooks.on_evaluation(self.step, self.last_eval)  # the run ends here whatever it answers
                if last_saved is None or last_saved.name != ckpt.step_dir_name(self.step):
                    last_saved = self.save(run.health, run.meter)
            if run.trace is not None:
                run.trace.close()
            run.profiler.close()
            run.logger.close()
        finally:
            self._restore_sigint()
            unlock_dir(self._run_lock)
        return self._summary(last_saved, stop_reason, run.resume)

    def _summary(self, checkpoint: Path | None, stopped_by: str | None, resumed_from: Path | None) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "steps": self.step, "tokens": self.tokens, "start_loss": self.start_loss,
                "end_loss": getattr(self, "last_loss", None), "eval": self.last_eval, "tb_dir": str(self.run_dir / "tb"),
                "checkpoint": str(checkpoint) if checkpoint else None, "stopped_by": stopped_by,
                "resumed_from": str(resumed_from) if resumed_from else None, "world_size": self.engine.world_size}

    # ------------------------------------------------------------------------------------- fit's steps
    def _nothing_to_do(self, resume: ckpt.Resume) -> dict[str, Any]:
        """A rerun of a finished run (at a budget, ``TrainConfig.budget_reached``): one line; no evaluation,
        checkpoint or log line."""
        if self.is_main:
            print(self.hooks.finished_line(resume, self.run_dir) or resume.nothing_to_do(self.run_dir, self.cfg.train), flush=True)
        state = ckpt.read_trainer_state(resume.path)
        self.step, self.tokens, self.last_eval = resume.step, int(state.get("tokens", 0)), state.get("eval") or {}
        self.start_loss, self.last_loss = state.get("start_loss"), state.get("last_loss")
        return self._summary(resume.path, "already_done", resume.path)

    def _start(self, resume: Path | None) -> _RunState:
        """config.yaml, logger / health / throughput, the resume, signal handlers (the run dir is open)."""
        from monitoring import HealthMonitor, RunLogger, ThroughputMeter, peak_remeasure, resolve_peak_flops
        from monitoring.profiler import StepProfiler
        from monitoring.sample_keys import SampleKeyLog

        cfg, t = self.cfg, self.cfg.train
        logger = RunLogger(self.run_dir, cfg.logging, is_main=self.is_main, total_steps=t.max_steps, config_dict=to_dict(cfg),
                           throughput_unit=getattr(self.task, "unit", "tok"))
        health = HealthMonitor(cfg.logging, logger)
        meter = ThroughputMeter(flops_per_sample(self.model_config, self.task),
                                resolve_peak_flops(cfg.logging.peak_flops, self.engine.device, t.precision),
                                self.engine.world_size,
                                remeasure_peak=peak_remeasure(cfg.logging.peak_flops, self.engine.device, t.precision))
        trained_seconds = 0.0  # the run's training time before this invocation (max_time_minutes budgets the run)
        if resume is not None:
            trained_seconds = self._restore(resume, health, meter)
            logger.truncate_after(self.step)
            logger.event(self.step, "resume", f"Resuming from {resume} at step {self.step} ({self.tokens} {self.task.counted}).", path=str(resume))
            if self.is_main:
                print(f"Resuming from {resume} (step {self.step}).", flush=True)
        if self.is_main:  # after the resume: a refused one leaves the config that wrote the checkpoints
            save_config(self.hooks.config_to_save or cfg, self.run_dir / "config.yaml")
        register_stack_dump()  # SIGUSR2: every thread's stack (where is a hung job?)
        self._restore_sigint = stop_signals.install(self._on_stop_signal, announce=self.is_main)
        profiler = StepProfiler(self.run_dir, cfg.logging.profile_steps, self.engine.rank, self.engine.device.type)
        self._started = time.time() - trained_seconds
        return _RunState(logger=logger, health=health, meter=meter, trace=SampleKeyLog.open(self.run_dir, cfg.logging.sample_keys, self.engine.rank), profiler=profiler,
                         resume=resume)

    def _reads_now(self, number: int, run: _RunState) -> bool:
        """Whether step ``number`` reads its host values before the next step is queued: a step that acts on
        them (module docstring). The rule is the same on every rank; a run of one rank also reads at once
        when a signal or its time budget is in, so that it stops at that step."""
        from monitoring.diagnostics import diagnostics_due

        t, lg = self.cfg.train, self.cfg.logging

        def every(n: int) -> bool:
            return n > 0 and number % n == 0

        one_rank = self.engine.world_size == 1
        return (not (t.read_late and self.engine.loss_check_on_device)
                or number == 1 or number >= t.max_steps or every(t.log_every) or every(t.eval_every)
                or every(t.checkpoint_every) or diagnostics_due(number, lg.diagnostics_every)
                or (not one_rank and every(lg.skew_every)) or t.max_tokens > 0 or run.trace is not None
                or (one_rank and (self._signal is not None or self._time_up())))

    def _train_step(self, batches: Any, run: _RunState, read_now: bool) -> _QueuedStep:
        """One optimizer step: ``grad_accum`` micro-batches forward (backward all but the last), the
        cross-rank agreement, the last backward and the update -- skipped if some rank's loss is NaN/Inf
        (the mean is then non-finite on every rank) or the gradients are. ``read_now``: read the step's
        host values before it ends (else ``fit`` reads them once the next step is queued)."""
        from monitoring.diagnostics import diagnostics_due, log_diagnostics

        t, engine = self.cfg.train, self.engine
        run.meter.start_step()
        micro = [next(batches) for _ in range(t.grad_accum_steps)]
        run.meter.data_ready()
        loss_sum, tokens, bad, keys, flops = None, 0, 0, [], 0.0
        for i, batch in enumerate(micro):
            keys.extend(batch.get("keys", []))
            bad += int(batch.get("num_bad", 0))
            tokens += self.task.tokens(batch)
            flops += self.task.batch_flops(batch, self.model_config) or 0.0
            boundary_loss = self.task.forward(engine, self._to_device(batch))["loss"]
            # summed on the device in float64 (what float() + float() did on the host): no read per micro-batch
            micro_loss = boundary_loss.detach().to(torch.float64)
            loss_sum = micro_loss if loss_sum is None else loss_sum + micro_loss
            if i < len(micro) - 1:
                engine.backward(boundary_loss)
        local_loss = loss_sum / t.grad_accum_steps
        number, arrived = self.step + 1, time.perf_counter()
        agreed = self._agreement(local_loss, tokens, bad, run)
        if engine.loss_check_on_device:  # the loss joins the gradients: x1.0 (bitwise the same) or x NaN (skipped)
            peer_wait = time.perf_counter() - arrived  # gloo blocks in the collective; on a GPU nothing waits here
            engine.backward(loss_or_nan(boundary_loss, agreed[0]))
            agreement: HostCopy | list[float] = HostCopy(agreed)
            if diagnostics_due(number, self.cfg.logging.diagnostics_every) and math.isfinite(agreement.tolist()[0]):
                log_diagnostics(run.logger, engine, step=number, cfg=self.cfg)  # gradients exist until engine.step()
            outcome = engine.step()
        else:  # the loss decides whether the backward and the update run: read it now
            agreement = agreed.tolist()
            peer_wait = time.perf_counter() - arrived  # blocked until the slowest rank arrived (and the device)
            if math.isfinite(agreement[0]):
                engine.backward(boundary_loss)  # the accumulation boundary: gradients are reduced here
                log_diagnostics(run.logger, engine, step=number, cfg=self.cfg)
                outcome = engine.step()  # skipped if the gradient norm is non-finite
            else:
                outcome = engine.skip_step(boundary_loss)  # weights, optimizer state and LR stay as they were
        self.step = number
        queued = _QueuedStep(number, agreement, outcome, peer_wait)
        if read_now:  # the wait for the device belongs to this step's time
            queued.read(engine.world_size)
        queued.rates.update(run.meter.end_step(len(keys) or t.grad_accum_steps * self.cfg.data.micro_batch_size, tokens,
                                               peer_wait, flops=flops or None))
        if run.trace is not None:  # logging.sample_keys: this rank's samples and own loss, one more host read
            run.trace.write(self.step, local_loss.item(), keys)
        return queued

    def _agreement(self, local_loss: torch.Tensor, tokens: int, bad: int, run: _RunState) -> torch.Tensor:
        """The step's one small all-reduce, on the loss's device: loss, tokens, bad samples and the stop
        flags (signal, wall time) summed over ranks, so every rank takes the same decisions from them.
        Its values are read by ``_QueuedStep.read`` (tests/pipelines/test_host_syncs.py counts the reads)."""
        host = torch.tensor([float(tokens), float(bad), float(self._signal or 0), float(self._time_up())],
                            dtype=torch.float64)
        return self.engine.all_reduce(torch.cat([local_loss.reshape(1), host.to(local_loss.device, non_blocking=True)]), "sum")

    def _time_up(self) -> bool:
        return 0 < self.cfg.train.max_time_minutes <= (time.time() - self._started) / 60

    def _finish_steps(self, queued: list[_QueuedStep], run: _RunState, *, keep_newest: bool) -> str | None:
        """Read the queued steps in order -- all, or all but the newest -- and act on each: counters,
        health, logs, stop flags. A stop found in an older step finishes the newest too (it has run)."""
        stop_reason = None
        while queued and (len(queued) > 1 or not keep_newest or stop_reason is not None):
            stop_reason = self._finish(queued.pop(0).read(self.engine.world_size), run, stopping=stop_reason is not None) \
                or stop_reason
        return stop_reason

    def _finish(self, step: _StepResult, run: _RunState, *, stopping: bool) -> str | None:
        """Count a read step; unless the run is already stopping, check its health, log it and return why
        to stop after it, if at all."""
        if not step.result["skipped"]:
            self.tokens += step.agg["tokens"]
            self.last_good_step = step.number
        if self.start_loss is None and math.isfinite(step.loss):
            self.start_loss = step.loss
        self.last_loss = step.loss
        if stopping:
            return None
        verdict = self._check_health(step, run)
        self._log_step(step, run)
        stop_reason = self._stop_reason(step, verdict)
        if stop_reason == "health":
            self.health_stop_step = step.number
        return stop_reason

    def _check_health(self, step: _StepResult, run: _RunState) -> str | None:
        """Bad samples, NaN/Inf and spikes, data starvation; the verdict is the same on every rank (its
        inputs are the all-reduced loss and the global gradient norm)."""
        if step.agg["bad"] > 0:
            run.logger.event(step.number, "bad_samples",
                             f"{step.agg['bad']} bad samples replaced this step (see worker logs for shard/key).")
        verdict = run.health.check(step.number, step.loss, step.result["grad_norm"])
        run.health.observe_data_wait(step.number, step.rates.get("data_wait_share", 0.0))
        return verdict

    def _log_step(self, step: _StepResult, run: _RunState) -> None:
        """Rank skew every ``skew_every`` steps (every rank takes part in the gather; rank 0 logs the
        slowest by busy time: step time less the wait for the others), train metrics every ``log_every``."""
        from monitoring import step_time_skew

        cfg, engine, number = self.cfg, self.engine, step.number
        if engine.world_size > 1 and cfg.logging.skew_every and number % cfg.logging.skew_every == 0:
            skew = step_time_skew(step.rates["busy_time"], engine.gather)
            run.logger.log(number, {k: v for k, v in skew.items() if k != "step_times"}, split="ranks")
        if number % cfg.train.log_every == 0 or number == 1:
            extra = {"loss_scale": step.result["loss_scale"]} if "loss_scale" in step.result else {}
            data = self.train_data.state_dict()
            # a mixture: samples each corpus has given so far (global: the mixture is over global sample slots)
            extra.update({f"samples/{name}": n for name, n in data.get("consumed", {}).items()})
            run.logger.log(number, {"loss": step.loss, "lr": step.result["lr"], "grad_norm": step.result["grad_norm"],
                                       "tokens": self.tokens, "epoch": data.get("epoch", 0), **extra, **step.rates})

    def _stop_reason(self, step: _StepResult, verdict: str | None) -> str | None:
        """Why to stop after this step, if at all (identical on every rank: from the all-reduce)."""
        if step.agg["signal"]:
            return "signal"
        if step.agg["time_up"]:
            return "max_time"
        if self.cfg.train.max_tokens and self.tokens >= self.cfg.train.max_tokens:
            return "max_tokens"
        return "health" if verdict == "stop" else None

    def _maybe_eval(self, stop_reason: str | None, run: _RunState) -> str | None:
        """Periodic evaluation (not at the last step: the end of ``fit`` evaluates); early stopping after it."""
        t = self.cfg.train
        if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps and stop_reason is None:
            self.last_eval = self.evaluate()
            run.logger.log(self.step, self.last_eval, split="eval")
            if self.hooks.on_evaluation(self.step, self.last_eval):
                return "early_stopping"
        return stop_reason

    def _maybe_checkpoint(self, stop_reason: str | None, run: _RunState, last_saved: Path | None) -> tuple[Path | None, bool]:
        """Checkpoint periodically and before an early stop; returns (newest checkpoint, leave the loop)."""
        t, logger = self.cfg.train, run.logger
        if stop_reason == "health":
            failed_at = self.health_stop_step or self.step
            last_saved = self._save_last_good(run.health, run.meter, last_saved)
            logger.event(failed_at, "stop", f"Stopped at step {failed_at}: non-finite loss or gradients "
                         f"(logging.nan_policy={self.cfg.logging.nan_policy}). {last_saved} holds the last good state "
                         f"(step {self.last_good_step}); its data position is past the failed batches.",
                         checkpoint=str(last_saved), failed_step=failed_at, last_good_step=self.last_good_step)
            return last_saved, True
        if stop_reason in ("max_tokens", "max_time"):  # a budget reached: finish like max_steps
            logger.event(self.step, "stop", f"Budget reached ({stop_reason}) at step {self.step}.")
            return last_saved, True
        periodic = t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.max_steps
        if periodic or stop_reason:  # the last step is saved at the end of fit, after the final evaluation
            last_saved = self.save(run.health, run.meter)
        if stop_reason:  # a signal is named where this rank got it (another rank's stops it too)
            signum = self._signal if stop_reason == "signal" else None
            stop_signals.record_stop(signum)
            again = " Run the same command again to continue from it." if stop_reason == "signal" else ""
            name = signal_name(signum)
            logger.event(self.step, "stop", f"Stopping early ({name or stop_reason}); checkpoint {last_saved}.{again}",
                         reason=stop_reason, **({"signal": name} if name else {}))
            return last_saved, True
        return last_saved, False

    # ------------------------------------------------------------------------------------------- pieces
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole ``eval_data`` split, each sample once across ranks (the last partial
        batch included), or over its first ``train.eval_batches`` batches per rank; all ranks."""
        if self.eval_data is None:
            return {}
        self.engine.eval()
        sums: dict[str, float] = {}
        for batch, counted in self.eval_data.evaluation_batches(limit=self.cfg.train.eval_batches or None):
            batch = self._to_device(batch)  # eval_sums compares outputs with the batch's labels: same device
            out = self.task.forward(self.engine, batch)  # every rank runs as many forwards (ZeRO-3 gathers in each)
            if counted:
                for k, v in self.task.eval_sums(out, batch).items():
                    sums[k] = sums.get(k, 0.0) + v
        names = sorted(sums)  # the same on every rank: each has a counted first batch (the sources refuse less)
        total = self.engine.all_reduce(torch.tensor([sums[k] for k in names], dtype=torch.float64), "sum")
        self.engine.train()
        return self.task.eval_metrics(dict(zip(names, total.tolist(), strict=True)))

    def save(self, health: Any = None, meter: Any = None) -> Path:
        state = {
            "version": 1, "step": self.step, "tokens": self.tokens, "start_loss": self.start_loss,
            "last_loss": getattr(self, "last_loss", None), "eval": self.last_eval, "task": self.task.name,
            "train_seconds": time.time() - self._started,  # the run's training time so far (max_time_minutes)
            "eval_batches": self.eval_data.eval_limit(self.cfg.train.eval_batches) if self.eval_data
            else self.cfg.train.eval_batches,
            "world_size": self.engine.world_size, "engine": self.cfg.distributed.engine,
            "zero_stage": self.cfg.distributed.zero_stage if self.engine.deepspeed else None,
            "precision": self.cfg.train.precision, "model_build": self.model_build, "param_shapes": self.param_shapes,
            "data_info": self.data_info,
            "data": self.train_data.state_dict(), "samples": self.train_data.state_dict().get("samples_seen", 0) * self.engine.world_size,
            "health": health.state_dict() if health is not None else {},
            "throughput": meter.state_dict() if meter is not None else {},
        }
        return ckpt.save_checkpoint(self.engine, self.run_dir, self.step, cfg=self.cfg, trainer_state=state,
                                    data_state=self.train_data.state_dict(), keep_last=self.cfg.train.keep_last,
                                    tokenizer_dir=self.tokenizer_dir)

    def _save_last_good(self, health: Any, meter: Any, last_saved: Path | None) -> Path:
        """The checkpoint a health stop leaves: the weights of ``last_good_step`` (bad steps are never
        applied), saved under that step so a resume goes on from there, with the data position past
        the failed batches. A checkpoint already written since that step holds the same weights."""
        if last_saved is not None and int(last_saved.name.split("-")[1]) >= self.last_good_step:
            return last_saved
        self.step = self.last_good_step
        health.consecutive_nan = 0  # the saved state is a good one: a resumed run starts a fresh count
        return self.save(health, meter)

    def _restore(self, path: Path, health: Any, meter: Any) -> float:
        """Load the checkpoint at ``path`` (of this model: ``open_for_resume``); returns the run's training seconds it holds."""
        state, rng, data_state = ckpt.load_rank_state(path, self.engine.rank)
        self.engine.load(path, state)
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.last_good_step = self.step
        self.start_loss, self.last_eval = state.get("start_loss"), state.get("eval") or {}
        self.train_data.load_state_dict(data_state or state["data"])
        if state.get("health"):
            health.load_state_dict(state["health"])
        if state.get("throughput"):
            meter.load_state_dict(state["throughput"])
        if rng is not None and state.get("world_size") == self.engine.world_size:
            ckpt.set_rng_state(rng)
        elif self.is_main:
            log.warning("World size changed (%s -> %s): RNG streams are re-seeded; resume is not bitwise exact.",
                        state.get("world_size"), self.engine.world_size)
        return float(state.get("train_seconds", 0.0))

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        dev = self.engine.device
        return {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def _on_stop_signal(self, signum: int) -> None:
        """SIGTERM / SIGUSR1 (SLURM pre-emption) / SIGINT (Ctrl-C): checkpoint at the next step boundary, then
        stop (``stop_signals``)."""
        self._signal = signum


def train(cfg: RunConfig) -> dict[str, Any]:
    """Pretrain per ``cfg`` in this process (one rank of the job); returns the final summary."""
    env = dist.init_env()
    data = open_run_data(cfg, env)
    tokenizer_dir = data.manifest.tokenizer_dir if corpus_kind(data.manifest.kind).tokenized else None
    model, build = build_model(cfg, data.task, tokenizer_dir)
    train_src, eval_src = build_sources(cfg, env, data, model)
    trainer = Trainer(cfg, model=model, task=data.task, train_data=train_src, eval_data=eval_src, env=env,
                      tokenizer_dir=tokenizer_dir, model_build=build, data_info=data.info)
    with preferred_attention(cfg.model.attention_backend):
        return trainer.fit()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("Run `python -m pipelines.pretrain CONFIG` instead.")

"""The training loop: ``Trainer.fit`` reads top to bottom; nothing here is model- or launcher-specific.

``train(cfg)`` is what ``python -m pipelines.pretrain`` runs in every process: it checks the corpus
and the config *before* any process group exists, builds task, model and data sources, and hands
them to ``Trainer``. Fine-tuning builds its own model/task/sources and reuses ``Trainer`` with its ``RunHooks``:

    trainer = Trainer(cfg, model=model, task=task, train_data=MapStyleSource(...), eval_data=MapStyleSource(...))
    summary = trainer.fit()

Every rank does the same number of steps on the same number of batches; one small all-reduce per
step carries the loss, token count and the stop flags (signal, wall time), so all ranks stop and
checkpoint at the same step boundary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from core import families
from core.config import ConfigError, save_config, to_dict
from core.corpus_kinds import corpus_kind
from pipelines.engine import checkpoint as ckpt
from pipelines.engine import distributed as dist
from pipelines.engine import engines
from pipelines.engine.config import RunConfig
from pipelines.engine.hooks import RunHooks
from pipelines.engine.model_build import build_model

__all__ = ["Trainer", "train", "build_model", "RunData", "open_run_data", "build_sources"]  # build_model: pipelines.engine.model_build

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
    started: float


@dataclasses.dataclass
class _StepResult:
    """One optimizer step as the later steps of ``fit`` see it."""

    loss: float  # mean over ranks (non-finite: the step was skipped)
    agg: dict[str, Any]  # the all-reduced sums and stop flags (``_reduce_metrics``)
    result: dict[str, Any]  # ``Engine.step`` / ``skip_step``: grad_norm, lr, skipped (+ loss_scale)
    rates: dict[str, float]  # throughput / MFU / data wait of this step


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
        from pipelines.engine.check import run_schedule
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
        schedule = run_schedule(cfg, d_model=getattr(self.model_config, "hidden_size", 0))
        self.engine = engines.build_engine(cfg, self.env, model, optimizer, schedule)
        self.is_main = self.engine.rank == 0
        self.run_dir = Path(cfg.train.run_dir)
        self.step = self.tokens = 0
        self.last_good_step = 0  # the newest step whose update was applied (or the resumed step)
        self.start_loss: float | None = None
        self.last_eval: dict[str, float] = {}
        self._signal: int | None = None

    # ------------------------------------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps`` (or a budget, a signal, a health stop, early stopping); return a summary."""
        run = self._start()
        batches = self.train_data.batches()
        self.engine.train()
        stop_reason, last_saved = None, None
        while self.step < self.cfg.train.max_steps:
            run.profiler.before(self.step + 1)
            step = self._train_step(batches, run)
            run.profiler.after(self.step)
            verdict = self._check_health(step, run)
            self._log_step(step, run)
            stop_reason = self._stop_reason(step, verdict)
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
        return {
            "run_dir": str(self.run_dir), "steps": self.step, "tokens": self.tokens, "start_loss": self.start_loss,
            "end_loss": getattr(self, "last_loss", None), "eval": self.last_eval,
            "checkpoint": str(last_saved) if last_saved else None, "tb_dir": str(self.run_dir / "tb"),
            "stopped_by": stop_reason, "resumed_from": str(run.resume) if run.resume else None,
            "world_size": self.engine.world_size,
        }

    # ------------------------------------------------------------------------------------- fit's steps
    def _start(self) -> _RunState:
        """Run dir and config.yaml, logger / health / throughput, resume from a checkpoint, signal handlers."""
        from monitoring import HealthMonitor, RunLogger, ThroughputMeter, peak_remeasure, resolve_peak_flops
        from monitoring.profiler import StepProfiler

        cfg, t = self.cfg, self.cfg.train
        error = None
        if self.is_main:
            try:
                ckpt.claim_run_dir(self.run_dir)
                ckpt.refuse_fresh_start_over_checkpoints(self.run_dir, self.cfg.train)
                save_config(self.hooks.config_to_save or cfg, self.run_dir / "config.yaml")
            except ConfigError as exc:  # raised on every rank below (no rank waits for a dead one)
                error = exc
        resume = ckpt.agree_on_resume(self.engine, self.run_dir, self.cfg.train.resume, error)
        logger = RunLogger(self.run_dir, cfg.logging, is_main=self.is_main, total_steps=t.max_steps, config_dict=to_dict(cfg),
                           throughput_unit=getattr(self.task, "unit", "tok"))
        health = HealthMonitor(cfg.logging, logger)
        meter = ThroughputMeter(self._flops_per_sample(),
                                resolve_peak_flops(cfg.logging.peak_flops, self.engine.device, t.precision),
                                self.engine.world_size,
                                remeasure_peak=peak_remeasure(cfg.logging.peak_flops, self.engine.device, t.precision))
        if resume is not None:
            self._restore(resume, health, meter)
            logger.truncate_after(self.step)
            logger.event(self.step, "resume", f"Resuming from {resume} at step {self.step} ({self.tokens} tokens).", path=str(resume))
            if self.is_main:
                print(f"Resuming from {resume} (step {self.step}).", flush=True)
        self._install_signal_handlers()
        profiler = StepProfiler(self.run_dir, cfg.logging.profile_steps, self.engine.rank, self.engine.device.type)
        return _RunState(logger=logger, health=health, meter=meter, trace=self._open_trace(), profiler=profiler,
                         resume=resume, started=time.time())

    def _train_step(self, batches: Any, run: _RunState) -> _StepResult:
        """One optimizer step: ``grad_accum`` micro-batches forward (backward all but the last), the
        cross-rank agreement, then the update -- unless some rank's loss is NaN/Inf (the mean is then
        non-finite on every rank) and the step is skipped."""
        from monitoring.diagnostics import log_diagnostics

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
        agg, peer_wait = self._reduce_metrics(local_loss, tokens, bad, run)
        loss = agg["loss"]
        if math.isfinite(loss):
            engine.backward(boundary_loss)  # the accumulation boundary: gradients are reduced here
            log_diagnostics(run.logger, engine, step=self.step + 1, cfg=self.cfg)  # gradients exist until engine.step()
            result = engine.step()  # skipped if the gradient norm is non-finite
        else:
            result = engine.skip_step(boundary_loss)  # weights, optimizer state and LR stay as they were
        self.step += 1
        if not result["skipped"]:
            self.tokens += agg["tokens"]
            self.last_good_step = self.step
        if self.start_loss is None and math.isfinite(loss):
            self.start_loss = loss
        self.last_loss = loss
        rates = run.meter.end_step(len(keys) or t.grad_accum_steps * self.cfg.data.micro_batch_size, tokens, peer_wait,
                                   flops=flops or None)
        if run.trace is not None:  # logging.sample_keys: this rank's samples and own loss, one more host read
            run.trace.write(json.dumps({"step": self.step, "loss": local_loss.item(), "keys": keys, "pid": os.getpid()}) + "\n")
            run.trace.flush()
        return _StepResult(loss=loss, agg=agg, result=result, rates=rates)

    def _reduce_metrics(self, local_loss: torch.Tensor, tokens: int, bad: int, run: _RunState) -> tuple[dict[str, Any], float]:
        """One small all-reduce before the update: mean loss, global tokens, bad samples and the stop flags
        (signal, wall time), so every rank takes the same decisions. Returns (sums, seconds waited for peers).

        This is the step's one host read of device values (the loss decides whether the update is
        applied): the loss stays on its device, the host counters join it there, one ``tolist()`` reads
        the sums back (tests/pipelines/test_host_syncs.py counts the reads per step)."""
        t = self.cfg.train
        time_up = t.max_time_minutes > 0 and (time.time() - run.started) / 60 >= t.max_time_minutes
        arrived = time.perf_counter()
        host = torch.tensor([float(tokens), float(bad), float(self._signal or 0), float(time_up)], dtype=torch.float64)
        agreed = self.engine.all_reduce(torch.cat([local_loss.reshape(1), host.to(local_loss.device, non_blocking=True)]), "sum")
        loss, tokens_sum, bad_sum, signal_sum, time_up_sum = agreed.tolist()
        peer_wait = time.perf_counter() - arrived  # blocked until the slowest rank arrived (and the device, on a GPU)
        return {"loss": loss / self.engine.world_size, "tokens": int(tokens_sum), "bad": int(bad_sum),
                "signal": signal_sum > 0, "time_up": time_up_sum > 0}, peer_wait

    def _check_health(self, step: _StepResult, run: _RunState) -> str | None:
        """Bad samples, NaN/Inf and spikes, data starvation; the verdict is the same on every rank (its
        inputs are the all-reduced loss and the global gradient norm)."""
        if step.agg["bad"] > 0:
            run.logger.event(self.step, "bad_samples",
                             f"{step.agg['bad']} bad samples replaced this step (see worker logs for shard/key).")
        verdict = run.health.check(self.step, step.loss, step.result["grad_norm"])
        run.health.observe_data_wait(self.step, step.rates.get("data_wait_share", 0.0))
        return verdict

    def _log_step(self, step: _StepResult, run: _RunState) -> None:
        """Rank skew every ``skew_every`` steps (every rank takes part in the gather; rank 0 logs the
        slowest by busy time: step time less the wait for the others), train metrics every ``log_every``."""
        from monitoring import step_time_skew

        cfg, engine = self.cfg, self.engine
        if engine.world_size > 1 and cfg.logging.skew_every and self.step % cfg.logging.skew_every == 0:
            skew = step_time_skew(step.rates["busy_time"], engine.gather)
            run.logger.log(self.step, {k: v for k, v in skew.items() if k != "step_times"}, split="ranks")
        if self.step % cfg.train.log_every == 0 or self.step == 1:
            extra = {"loss_scale": step.result["loss_scale"]} if "loss_scale" in step.result else {}
            data = self.train_data.state_dict()
            # a mixture: samples each corpus has given so far (global: the mixture is over global sample slots)
            extra.update({f"samples/{name}": n for name, n in data.get("consumed", {}).items()})
            run.logger.log(self.step, {"loss": step.loss, "lr": step.result["lr"], "grad_norm": step.result["grad_norm"],
                                       "tokens": self.tokens, "epoch": data.get("epoch", 0),
                                       **extra, **step.rates})

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
            failed_at = self.step
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
        if stop_reason:
            logger.event(self.step, "stop", f"Stopping early ({stop_reason}); checkpoint {last_saved}.", reason=stop_reason)
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
            "world_size": self.engine.world_size, "engine": self.cfg.distributed.engine,
            "zero_stage": self.cfg.distributed.zero_stage if self.engine.deepspeed else None,
            "precision": self.cfg.train.precision, "model_build": self.model_build, "data_info": self.data_info,
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

    def _restore(self, path: Path, health: Any, meter: Any) -> None:
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

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        dev = self.engine.device
        return {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def _flops_per_sample(self) -> float:
        try:
            from models.flops import training_flops_per_sample

            return float(training_flops_per_sample(self.model_config, **self.task.flops_kwargs()))
        except Exception:  # noqa: BLE001 - MFU is optional (custom models have no FLOP count)
            return 0.0

    def _install_signal_handlers(self) -> None:
        """SIGTERM / SIGUSR1 (SLURM pre-emption): checkpoint at the next step boundary, then stop.
        SIGUSR2: print every thread's stack (where is a hung job?)."""
        from pipelines.loading.workers import register_stack_dump

        def handler(signum: int, _frame: Any) -> None:
            self._signal = signum

        register_stack_dump()

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass

    def _open_trace(self):
        """``logging.sample_keys``: this rank's append-only sample-key log (docs/monitoring.md), or None."""
        where = self.cfg.logging.sample_keys
        if not where:
            return None
        where = self.run_dir / where  # an absolute path stays as it is
        where.mkdir(parents=True, exist_ok=True)
        return open(where / f"rank-{self.engine.rank}.jsonl", "a", encoding="utf-8")


@dataclasses.dataclass
class RunData:
    """What a pretraining run reads, opened and checked before any model exists (``open_run_data``)."""

    task: Any
    manifest: Any  # the first corpus: the task, the eval split and the release's tokenizer come from it
    corpus: Any  # the manifest, or [(name, weight, manifest)] for a mixture
    info: dict[str, Any]  # the checkpoint's ``data_info``


def open_run_data(cfg: RunConfig, env: dist.DistEnv) -> RunData:
    """Load and verify the corpus (or mixture) of ``cfg`` and build its task."""
    from pipelines.engine import objectives as tasks
    from pipelines.loading import loader as data_mod
    from pipelines.loading.blend import check_blendable

    dist.validate(cfg, env)
    if cfg.train.task not in families.pretraining_tasks():
        raise ConfigError(f"train.task={cfg.train.task} is a fine-tuning task; pretraining supports "
                          f"{', '.join(families.pretraining_tasks())}.")
    kind = families.family_of_model(cfg.model.name).corpus_kind  # what the model's family reads (its spec says)
    d = cfg.data
    specs = [(c.name, c.weight, c.path, c.url_prefix or d.url_prefix) for c in d.corpora] or [("", 1.0, d.corpus, d.url_prefix)]
    manifests = [data_mod.load_manifest(path, kind=kind, url_prefix=prefix) for _, _, path, prefix in specs]
    check_blendable(manifests, [name or str(m.root) for (name, *_), m in zip(specs, manifests, strict=True)])
    manifest = manifests[0]
    for i, m in enumerate(manifests):
        data_mod.verify_shards(m, ["train"] + ([d.eval_split] if i == 0 and d.eval_split in m.splits else []),
                               checksums=d.verify_checksums, rank=env.rank, world=env.world_size)
    corpus = [(name, weight, m) for (name, weight, _, _), m in zip(specs, manifests, strict=True)] if d.corpora else manifest
    mixture = [{"name": n, "weight": w, "path": str(m.root)} for (n, w, _, _), m in zip(specs, manifests, strict=True)]
    info = {"corpus": str(manifest.root), "corpora": mixture if d.corpora else [], "kind": manifest.kind,
            "seq_len": manifest.seq_len, "class_map": manifest.class_map,
            "splits": {k: v.get("samples") for k, v in manifest.raw.get("splits", {}).items()},
            "tokens": {k: v.get("tokens") for k, v in manifest.raw.get("splits", {}).items()},
            "tokenizer": manifest.raw.get("tokenizer", {})}
    return RunData(task=tasks.build_task(cfg, manifest), manifest=manifest, corpus=corpus, info=info)


def build_sources(cfg: RunConfig, env: dist.DistEnv, data: RunData, model: torch.nn.Module) -> tuple[Any, Any]:
    """The train source (shuffled with ``train.seed``) and the eval source (None without the split) of a run."""
    from pipelines.loading import loader as data_mod

    d, manifest = cfg.data, data.manifest
    common = dict(rank=env.rank, world=env.world_size, num_workers=d.num_workers,
                  prefetch_factor=d.prefetch_factor, on_bad_sample=d.on_bad_sample, pin_memory=env.device == "cuda",
                  max_bad_share=d.max_bad_share, verify_checksums=d.verify_checksums,
                  start_method=d.worker_start_method,
                  limits=data_mod.SampleLimits.of_model(model, manifest.kind))  # a sample the model cannot take is a bad sample
    train_src = data_mod.StreamingSource(data.corpus, "train", data.task.collate, micro_batch_size=d.micro_batch_size,
                                         grad_accum=cfg.train.grad_accum_steps, seed=cfg.train.seed, shuffle=True,
                                         shuffle_buffer=d.shuffle_buffer, train=True, **common)
    eval_src = None
    if d.eval_split in manifest.splits:
        total = sum(s.samples for s in manifest.shards(d.eval_split))
        eval_mb = max(1, min(d.micro_batch_size, total // env.world_size))
        eval_src = data_mod.StreamingSource(manifest, d.eval_split, data.task.collate, micro_batch_size=eval_mb,
                                            shuffle=False, train=False, seed=cfg.train.seed, **common)
    return train_src, eval_src


def train(cfg: RunConfig) -> dict[str, Any]:
    """Pretrain per ``cfg`` in this process (one rank of the job); returns the final summary."""
    env = dist.init_env()
    data = open_run_data(cfg, env)
    model, build = build_model(cfg, data.task)
    train_src, eval_src = build_sources(cfg, env, data, model)
    trainer = Trainer(cfg, model=model, task=data.task, train_data=train_src, eval_data=eval_src, env=env,
                      tokenizer_dir=data.manifest.tokenizer_dir if corpus_kind(data.manifest.kind).tokenized else None,
                      model_build=build, data_info=data.info)
    return trainer.fit()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("Run `python -m pipelines.pretrain CONFIG` instead.")

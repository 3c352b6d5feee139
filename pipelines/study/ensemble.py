"""Many runs of a sweep trained as one batched model: the warmup map's hundreds of small runs on one GPU.

A small run leaves a GPU idle: a width-128 model's step is a few hundred kernel launches of microseconds of
work each, and processes sharing the GPU take turns rather than overlap (H100, 2026-11-26: 12 processes of
the warmup map reached 41 steps/s in all, 0.29 s a step each). But the runs of a sweep that differ only in
what the optimizer does with the gradients -- Adam or RAdam, learning rate, betas, eps, decay, clipping,
warmup schedule -- and in the seed share everything else: architecture, batch shapes, number of steps. An
*ensemble* trains N such runs (its *members*) at once:

- every member's weights are initialised by ``build_model`` with the member's seed, as its run's are, and
  become one row of an ``[N, P]`` fp32 tensor; ``torch.func.vmap`` over ``functional_call`` runs all the
  members' forward passes with the kernels of one, each member on the batches its seed's loader gives its
  run (members with one seed share a loader);
- one backward of the sum of the members' losses gives each member its own gradient (rows share nothing);
- ``member_math.MemberAdam`` steps every row with its run's optimizer and schedule, ``member_diagnostics``
  measures every row as ``monitoring.diagnostics`` measures a run;
- each member writes what its run writes -- ``config.yaml``, ``metrics.jsonl`` (train records every
  ``log_every``, diagnostics every ``diagnostics_every``, evaluations, health events), the sweep's ``done``
  marker and ``sweep.jsonl`` line -- so ``pretrain report`` reads ensemble runs like any others. A member
  whose loss or gradient goes non-finite skips or stops (``logging.nan_policy``) while the others go on.

The numbers are the one-run-at-a-time numbers up to float rounding (batched matmuls sum in another order);
tests/pipelines/test_ensemble.py trains a grid both ways and compares what they log. Not done by an
ensemble, so such runs go through ``sweep.run_one`` as before (``ensemble_reason`` says why): checkpoints
(an interrupted ensemble starts again from step 0 next time, its run dirs replaced), gradient
accumulation, mixed precision, dropout (each member would need its run's RNG stream), budgets in time or
tokens, more than one process, objectives other than ``causal_lm``. Entry point: the sweep's ``ensemble: N``
(``pretrain sweep ... ensemble=96 --local``; benchmarks/warmup_map_gpu.sh).
"""

from __future__ import annotations

import json
import math
import signal
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import save_config, to_dict
from core.files import atomic_write_text, discard
from pipelines.engine.config import RunConfig

__all__ = ["MEMBER_OPTIMIZERS", "ensemble_reason", "ensemble_key", "plan_ensembles", "run_ensemble", "EnsembleTooLarge"]

MEMBER_OPTIMIZERS = {"adam": False, "radam": True}  # name -> RAdam's rectification
MARKER = "ensemble.json"  # in each member's run dir: written by an ensemble (its leftovers may be replaced)
_MEMBER_FIELDS = {"optim": ("name", "lr", "betas", "eps", "weight_decay", "grad_clip"), "schedule": None,
                  "train": ("seed", "run_dir")}


class EnsembleTooLarge(RuntimeError):
    """The device ran out of memory: the caller splits the ensemble."""


def ensemble_reason(cfg: RunConfig) -> str | None:
    """Why the run ``cfg`` cannot be an ensemble member (None: it can)."""
    t, o = cfg.train, cfg.optim
    checks = [
        (o.name not in MEMBER_OPTIMIZERS, f"optim.name={o.name} (ensembles step {', '.join(MEMBER_OPTIMIZERS)})"),
        (o.decoupled_weight_decay and o.weight_decay > 0, "decoupled weight decay"),
        (t.task != "causal_lm", f"train.task={t.task} (ensembles train causal_lm)"),
        (t.precision != "fp32", f"train.precision={t.precision}"),
        (t.grad_accum_steps != 1 or t.global_batch_size not in (0, cfg.data.micro_batch_size),
         "gradient accumulation (or a train.global_batch_size other than data.micro_batch_size)"),
        (bool(t.max_tokens or t.max_time_minutes), "a token or time budget"),
        (t.checkpoint_every > 0, "periodic checkpoints (ensembles write none)"),
        (bool(cfg.model.activation_checkpointing or cfg.model.init_from), "activation checkpointing or init_from"),
        (bool(cfg.logging.sample_keys or cfg.logging.profile_steps), "logging.sample_keys or profile_steps"),
        (_has_dropout(cfg), "dropout (each member would need its run's RNG stream)"),
    ]
    reasons = [why for bad, why in checks if bad]
    return "; ".join(reasons) or None


def _has_dropout(cfg: RunConfig) -> bool:
    from models.registry import get_config

    try:
        default = get_config(cfg.model.name)
    except ValueError:
        return True  # an unknown model: not ours to batch
    over = cfg.model.overrides
    return any(float(over.get(k, getattr(default, k, 0.0)) or 0.0) > 0 for k in ("hidden_dropout", "attention_dropout"))


def ensemble_key(cfg: RunConfig) -> str:
    """What members of one ensemble share: the resolved config without the per-member fields."""
    data = to_dict(cfg)
    for section, fields in _MEMBER_FIELDS.items():
        if fields is None:
            data.pop(section, None)
        else:
            for name in fields:
                data.get(section, {}).pop(name, None)
    return json.dumps(data, sort_keys=True, default=str)


def _resumable_single_run(run_dir: Path) -> bool:
    """A run dir an earlier one-at-a-time attempt left (not an ensemble's): ``run_one`` resumes it."""
    return run_dir.exists() and not (run_dir / MARKER).is_file()


def plan_ensembles(specs: list[Any], configs: list[RunConfig], size: int) -> tuple[list[list[int]], list[int]]:
    """Indices into ``specs`` grouped into ensembles of at most ``size`` members (grid order kept), and the
    indices that run one at a time (``ensemble_reason``, a resumable run dir, or alone in their group)."""
    groups: dict[str, list[int]] = {}
    singles: list[int] = []
    for i, (spec, cfg) in enumerate(zip(specs, configs, strict=True)):
        if ensemble_reason(cfg) or _resumable_single_run(Path(spec.run_dir)):
            singles.append(i)
        else:
            groups.setdefault(ensemble_key(cfg), []).append(i)
    ensembles = []
    for members in groups.values():
        for start in range(0, len(members), size):
            chunk = members[start:start + size]
            if len(chunk) > 1:
                ensembles.append(chunk)
            else:
                singles.extend(chunk)
    return ensembles, sorted(singles)


@dataclass
class _Member:
    """One run of the ensemble as its run dir sees it."""

    spec: Any
    cfg: RunConfig
    logger: Any
    health: Any
    alive: bool = True
    step: int = 0
    tokens: int = 0
    stopped: str | None = None  # "health" or "signal"


def run_ensemble(specs: list[Any], configs: list[RunConfig], *, threads: int = 0) -> list[dict[str, Any]]:
    """Train ``specs`` (``pipelines.study.sweep.RunSpec`` s with their resolved ``configs``) as one ensemble; per
    member ``{"finished", "stopped_by", "error"}`` (a failure is every member's, not an exception). Raises
    ``EnsembleTooLarge`` when the device runs out of memory: the caller splits the ensemble (its run dirs are
    replaced on the next try)."""
    from pipelines.engine.distributed import in_process_run

    members: list[_Member] = []
    error = None
    with in_process_run(threads), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented the "
                                "batching rule")  # CPU attention under vmap loops over the members (CUDA's kernels batch)
        try:
            _train(specs, configs, members)
        except torch.cuda.OutOfMemoryError as exc:
            for m in members:
                m.logger.close()
            members.clear()
            torch.cuda.empty_cache()
            raise EnsembleTooLarge(f"out of memory with {len(specs)} members: {exc}") from None
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed ensemble is a result of the sweep (its runs are retried)
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    return _outcomes(specs, configs, members, error)


@dataclass
class _Parts:
    """What the members share: data, the model they run through, their weights as rows and the optimizer."""

    data: Any  # trainer.RunData of the first member (all members read the same corpus)
    base: torch.nn.Module  # the architecture ``functional_call`` runs each row's weights through
    layout: Any  # member_math.ColumnLayout
    weights: torch.Tensor  # [N, P] fp32, requires grad
    opt: Any  # member_math.MemberAdam
    seeds: list[int]
    sources: dict[int, tuple[Any, Any]]  # seed -> (train source, eval source)
    streams: dict[int, Any]  # seed -> the train source's batch iterator
    row_of_seed: torch.Tensor  # member -> index into ``seeds``
    device: torch.device


def member_rows(models: list[torch.nn.Module], device: torch.device) -> torch.Tensor:
    """Each model's parameters flattened into one row of a ``[members, params]`` tensor on ``device``.

    Read where the models were built (the host), without moving any of them: ``Module.to`` works in place,
    so moving the first model before this read mixed devices in one ``cat`` (the first GPU map, 2026-11-27).
    """
    return torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]).to(device)


def _build(configs: list[RunConfig]) -> _Parts:
    """Each member's model as its run would build it (seeded init), stacked into rows; a loader per seed."""
    from pipelines.engine import distributed as dist
    from pipelines.engine.check import run_schedule
    from pipelines.engine.model_build import build_model
    from pipelines.engine.optim import no_weight_decay
    from pipelines.engine.trainer import build_sources, open_run_data
    from pipelines.study.member_math import ColumnLayout, MemberAdam, MemberHyper

    env = dist.init_env()
    data = open_run_data(configs[0], env)
    models = [build_model(cfg, data.task)[0] for cfg in configs]  # each seeded with its run's train.seed
    device = torch.device(env.device, env.local_rank) if env.device == "cuda" else torch.device(env.device)
    weights = member_rows(models, device).requires_grad_(True)
    base = models[0].to(device)  # in place: the rows above are read first
    named = list(base.named_parameters())
    layout = ColumnLayout([n for n, _ in named], [p.shape for _, p in named], [no_weight_decay(n, p) for n, p in named],
                          device)
    hyper = [MemberHyper(rectified=MEMBER_OPTIMIZERS[c.optim.name], lr=c.optim.lr, beta1=c.optim.betas[0],
                         beta2=c.optim.betas[1], eps=c.optim.eps, weight_decay=c.optim.weight_decay,
                         grad_clip=c.optim.grad_clip, schedule=run_schedule(c, d_model=base.config.hidden_size))
             for c in configs]
    seeds = sorted({c.train.seed for c in configs})
    sources = {s: build_sources(next(c for c in configs if c.train.seed == s), env, data, base) for s in seeds}
    return _Parts(data=data, base=base, layout=layout, weights=weights, opt=MemberAdam(weights, layout, hyper),
                  seeds=seeds, sources=sources, streams={s: src.batches() for s, (src, _) in sources.items()},
                  row_of_seed=torch.tensor([seeds.index(c.train.seed) for c in configs], device=device), device=device)


def _open_members(specs: list[Any], configs: list[RunConfig], members: list[_Member]) -> None:
    """Each member's run dir (an interrupted ensemble's leftovers replaced), config.yaml, logger and health monitor."""
    from monitoring import HealthMonitor, RunLogger
    from pipelines.engine.checkpoint import claim_run_dir

    for spec, cfg in zip(specs, configs, strict=True):
        run_dir = Path(spec.run_dir)
        if (run_dir / MARKER).is_file():
            discard(run_dir)  # ours: the marker says so
        claim_run_dir(run_dir)
        atomic_write_text(run_dir / MARKER, json.dumps({"members": [s.name for s in specs]}) + "\n")
        save_config(cfg, run_dir / "config.yaml")
        logger = RunLogger(run_dir, cfg.logging, is_main=True, total_steps=cfg.train.max_steps, config_dict=to_dict(cfg),
                           console=False)  # the ensemble prints one line for all its members
        members.append(_Member(spec, cfg, logger, HealthMonitor(cfg.logging, logger)))


def _forward_backward(parts: _Parts, members: list[_Member], member_losses: Any) -> tuple[list[float], list[float], int]:
    """Every member's loss on its seed's next batch, one backward for all; (losses, gradient norms, tokens a member)."""
    by_seed = [next(parts.streams[s]) for s in parts.seeds]
    ids = torch.stack([b["input_ids"] for b in by_seed]).to(parts.device)[parts.row_of_seed]
    labels = torch.stack([b["labels"] for b in by_seed]).to(parts.device)[parts.row_of_seed]
    parts.weights.grad = None
    losses = member_losses(parts.layout.views(parts.weights), ids, labels)
    live = torch.tensor([m.alive for m in members], device=parts.device)
    torch.where(live, losses, 0.0).sum().backward()  # rows share no weight: each gets its own member's gradient
    norms = torch.linalg.vector_norm(parts.weights.grad, dim=1)  # fp32, as clip_grad_norm_ takes it
    read = torch.cat([losses.detach(), norms]).tolist()  # the step's one host read
    return read[:len(members)], read[len(members):], parts.data.task.tokens(by_seed[0])


def _after_step(parts: _Parts, members: list[_Member], step: int, loss: list[float], norm: list[float],
                applied: list[bool], tokens: int, step_time: float, lrs: list[float]) -> None:
    """What the trainer does after an update, per running member: health check, train record (``lrs``: the
    rates this step's updates used, as the trainer logs them), a health stop."""
    t = members[0].cfg.train
    logging_step = step % t.log_every == 0 or step == 1
    epochs = {s: src.state_dict().get("epoch", 0) for s, (src, _) in parts.sources.items()} if logging_step else {}
    for i, m in enumerate(members):
        if not m.alive:
            continue
        m.step = step
        m.tokens += tokens if applied[i] else 0
        grad_norm = norm[i] if math.isfinite(loss[i]) else None  # a skipped step reports none (skip_step)
        verdict = m.health.check(step, loss[i], grad_norm)
        if logging_step:
            m.logger.log(step, {"loss": loss[i], "lr": lrs[i], "grad_norm": grad_norm, "tokens": m.tokens,
                                "epoch": epochs[m.cfg.train.seed], "step_time": step_time,
                                "tokens_per_s": tokens / step_time, "ensemble_size": len(members)})
        if verdict == "stop":
            m.alive, m.stopped = False, "health"
            m.logger.event(step, "stop", f"Stopped at step {step}: non-finite loss or gradients "
                           f"(logging.nan_policy={m.cfg.logging.nan_policy}); an ensemble member keeps no checkpoint.",
                           failed_step=step, last_good_step=parts.opt.updates_done[i])


def _train(specs: list[Any], configs: list[RunConfig], members: list[_Member]) -> None:
    """Build the ensemble, open its members' run dirs (filling ``members``), then train: the trainer's loop for all."""
    from torch.func import functional_call, vmap

    from monitoring.diagnostics import diagnostics_due
    from pipelines.study.member_math import member_diagnostics

    parts = _build(configs)
    _open_members(specs, configs, members)

    def outputs_of(params: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return functional_call(parts.base, params, (ids,), {"labels": labels})

    member_losses, member_outputs = vmap(lambda *a: outputs_of(*a)["loss"]), vmap(outputs_of)
    signalled: list[int] = []
    handlers = {}
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # a pre-emption or the GPU script's time limit: stop at a step boundary
        try:
            handlers[sig] = signal.signal(sig, lambda signum, _frame: signalled.append(signum))
        except ValueError:  # not the main thread
            pass
    t, opt = configs[0].train, parts.opt
    try:
        parts.base.train()
        for step in range(1, t.max_steps + 1):
            if signalled:
                for m in members:
                    m.stopped = m.stopped or "signal"
                break
            tick = time.perf_counter()
            loss, norm, tokens = _forward_backward(parts, members, member_losses)
            due = [i for i, m in enumerate(members)
                   if m.alive and math.isfinite(loss[i]) and diagnostics_due(step, m.cfg.logging.diagnostics_every)]
            if due:  # before the update, as the trainer logs them
                for i, record in zip(due, member_diagnostics(opt, parts.weights.grad, due, update=[step] * len(due)),
                                     strict=True):
                    members[i].logger.log(step, record, split="diag")
            applied = [m.alive and math.isfinite(loss[i]) and math.isfinite(norm[i]) for i, m in enumerate(members)]
            lrs = opt.lrs()
            opt.step(parts.weights.grad, applied, opt.clip_coefficients(norm))
            step_time = time.perf_counter() - tick
            _after_step(parts, members, step, loss, norm, applied, tokens, step_time, lrs)
            if t.eval_every and step % t.eval_every == 0 and step < t.max_steps:
                _evaluate(members, member_outputs, parts, step)
            if step % 50 == 0 or step == t.max_steps:
                print(f"ensemble of {len(members)}: step {step}/{t.max_steps}, {sum(m.alive for m in members)} "
                      f"running, {step_time * 1000:.0f} ms/step", flush=True)
        else:
            _evaluate(members, member_outputs, parts, t.max_steps)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@torch.no_grad()
def _evaluate(members: list[_Member], member_outputs: Any, parts: _Parts, step: int) -> None:
    """The trainer's evaluation for every running member: the same ``train.eval_batches`` batches, summed by the
    task's ``eval_sums`` per member."""
    rows = [i for i, m in enumerate(members) if m.alive]
    source = parts.sources[parts.seeds[0]][1]
    if source is None or not rows:
        return
    limit = members[0].cfg.train.eval_batches or None
    sums: list[dict[str, float]] = [{} for _ in rows]
    params = {k: v[rows] for k, v in parts.layout.views(parts.weights).items()}
    parts.base.eval()
    for batch, counted in source.evaluation_batches(limit=limit):
        if not counted:
            continue
        on_device = {k: (v.to(parts.device) if torch.is_tensor(v) else v) for k, v in batch.items()}
        out = member_outputs(params, on_device["input_ids"].expand(len(rows), -1, -1),
                             on_device["labels"].expand(len(rows), -1, -1))
        for j in range(len(rows)):
            for k, v in parts.data.task.eval_sums({name: value[j] for name, value in out.items()}, on_device).items():
                sums[j][k] = sums[j].get(k, 0.0) + v
    parts.base.train()
    for j, i in enumerate(rows):
        members[i].logger.log(step, parts.data.task.eval_metrics(sums[j]), split="eval")


def _outcomes(specs: list[Any], configs: list[RunConfig], members: list[_Member], error: str | None) -> list[dict[str, Any]]:
    """Per member: whether it trained to ``max_steps`` (``finished``), what stopped it, the ensemble's error."""
    for m in members:
        m.logger.close()
    by_name = {m.spec.name: m for m in members}
    out = []
    for spec, cfg in zip(specs, configs, strict=True):
        m = by_name.get(spec.name)
        finished = m is not None and m.stopped is None and m.step == cfg.train.max_steps and error is None
        out.append({"finished": finished, "stopped_by": m.stopped if m is not None else None, "error": error})
    return out

"""The two training engines the loop talks to — plain DDP and DeepSpeed ZeRO — behind one interface.

``Engine`` is the interface and the shared plumbing (forward, train/eval mode, collectives, the LR
scheduler's file). ``DDPEngine`` (``distributed.engine: ddp``) runs accelerate's DDP with torch
optimizers: it clips and steps itself, and under ``train.precision`` bf16 / fp16 it autocasts, with
dynamic loss scaling (``torch.amp.GradScaler``) for fp16. ``DeepSpeedEngine`` hands backward, step,
clipping, loss scaling and ZeRO partitioning to DeepSpeed. ``build_engine`` creates the
``Accelerator`` for either and returns the matching class: the loop never asks which it has.

Every ``step()`` returns a ``StepOutcome``: ``{"grad_norm", "lr", "skipped"}`` (+ ``loss_scale`` under fp16),
now or a step later (``host_reads``); a step whose gradients are non-finite is not applied. An engine with
``loss_check_on_device`` needs no host read of the loss before its update: the loop multiplies the last
backward's loss by NaN when the ranks' loss is non-finite, and the engine skips that step on the
gradients' non-finite norm.

Both also answer what diagnostics ask (``monitoring.diagnostics.DiagnosticsEngine``): full per-parameter
gradients, optimizer state and weights, the optimizer's groups and facts, and the clipping factor,
so that only this package knows DeepSpeed's internals.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from monitoring.diagnostics import ParameterReads
from pipelines.engine.check import one_graph_per_block
from pipelines.engine.config import RunConfig
from pipelines.engine.deepspeed_reads import deepspeed_getters
from pipelines.engine.distributed import DistEnv, deepspeed_config, group_backend
from pipelines.engine.host_reads import HostCopy, StepOutcome, skipped_if
from pipelines.engine.model_build import compile_blocks_if, compile_kwargs
from pipelines.engine.one_rank import one_rank_fast_path_, skip_one_rank_allreduce_, unwrap_one_rank_ddp
from pipelines.engine.registries import OPTIMIZERS
from pipelines.engine.reshard import WORLD_FREE_DIR, load_world_free, save_world_free
from pipelines.engine.zero_step import device_step, host_grad_norm, zero_step_on_device_

__all__ = ["Engine", "DDPEngine", "DeepSpeedEngine", "build_engine", "deepspeed_getters", "skip_one_rank_allreduce_"]

class Engine:
    """The wrapped model as the loop sees it: ``engine(**inputs)``, ``backward``, ``step``, ``skip_step``,
    ``save``, ``load`` and the collectives. Subclasses implement the five engine-specific methods."""

    deepspeed = False  # which engine (read by checkpoints, never branched on here)
    reads_are_collective = False  # parameter_reads() are collectives: every rank must call (ZeRO)
    grads_before_step = True  # gradients exist between backward() and step() (not when backward steps)
    # NaN gradients at the accumulation boundary skip the update with nothing else changed (weights,
    # optimizer state, LR, loss scale): the loop may then fold a non-finite loss into them (module docstring)
    loss_check_on_device = False

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, cfg: RunConfig):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.grad_accum, self.grad_clip = cfg.train.grad_accum_steps, cfg.optim.grad_clip
        self.module = model.module if hasattr(model, "module") else model
        self.module = getattr(self.module, "_orig_mod", self.module)  # torch.compile wrapper (ddp engine)
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.device = accelerator.device
        self.fp16 = cfg.train.precision == "fp16"
        self.optimizer_facts = OPTIMIZERS.lookup(cfg.optim.name)  # the registered entry: adam_update, ...
        self._micro = 0
        self._unsettled: tuple[HostCopy, StepOutcome] | None = None  # a step skipped or not on the device

    # -- the same for both engines
    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        return self.model(**inputs)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def settle(self) -> None:
        """Read the norm the last ``step()`` left on the device when the update's skip was decided there (an
        invalid norm: skipped): step the LR schedule if the update was applied, and resolve the outcome."""
        if self._unsettled is None:
            return
        (norm_copy, outcome), self._unsettled = self._unsettled, None
        (norm,) = norm_copy.tolist()
        skipped, applied_lr = not math.isfinite(norm), self.lr()
        if skipped:
            self._count_skipped()
        else:
            self.scheduler.step()
        outcome.resolve({"grad_norm": norm, "lr": applied_lr, "skipped": skipped})

    def _read_later(self, norm: HostCopy) -> StepOutcome:
        """This step's outcome, resolved by ``settle`` from ``norm`` (the next step settles it first)."""
        outcome = StepOutcome(settle=self.settle)
        self._unsettled = (norm, outcome)
        return outcome

    def _count_skipped(self) -> None:
        """Count a step skipped on the device where the engine keeps such a count."""

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``t`` summed (or maxed) over ranks, on ``t``'s device; the collective runs on the engine's device
        (NCCL reduces only GPU tensors, and the counters callers build are CPU tensors)."""
        if not (torch.distributed.is_initialized() and self.world_size > 1):
            return t
        work = t.to(self.device)
        torch.distributed.all_reduce(work, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
        return work.to(t.device)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` in rank order (all ranks must call it), on ``t``'s device."""
        if not (torch.distributed.is_initialized() and self.world_size > 1):
            return t
        work = t.to(self.device)
        parts = [torch.empty_like(work) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, work)
        return torch.cat(parts).to(t.device)

    def barrier(self) -> None:
        if torch.distributed.is_initialized() and self.world_size > 1:
            torch.distributed.barrier()

    def clip_coefficient(self, grad_norm: float) -> float:
        """The factor clipping applies to gradients of global norm ``grad_norm`` (``optim.grad_clip``, 0 = off;
        torch's ``clip_grad_norm_`` and DeepSpeed's ``gradient_clipping`` share max_norm / (norm + 1e-6))."""
        if self.grad_clip > 0 and math.isfinite(grad_norm):
            return min(1.0, self.grad_clip / (grad_norm + 1e-6))
        return 1.0

    def _save_scheduler(self, path: Path) -> None:
        if self.rank == 0:
            (path / "engine").mkdir(parents=True, exist_ok=True)
            torch.save(self.scheduler.state_dict(), path / "engine" / "lr_scheduler.pt")

    def _load_scheduler(self, path: Path) -> None:
        """The saved schedule position, with this run's base rates and schedule: ``optim.lr``, ``max_steps``
        or ``schedule.*`` changed on resume apply from the first update on (a loaded LambdaLR would keep
        the saved base rates, and the optimizer the saved step's rate). Unchanged, the rate is the
        saved one bit for bit: LambdaLR computes it the same way."""
        from models.safe_load import safe_torch_load

        base_lrs = list(self.scheduler.base_lrs)  # from this run's optimizer groups, as built from its config
        self.scheduler.load_state_dict(safe_torch_load(path / "engine" / "lr_scheduler.pt"))
        self.scheduler.base_lrs = base_lrs
        groups = self.scheduler.optimizer.param_groups
        for group, base, factor in zip(groups, base_lrs, self.scheduler.lr_lambdas, strict=True):
            group["initial_lr"], group["lr"] = base, base * factor(self.scheduler.last_epoch)

    # -- engine-specific
    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (lr, betas, eps, weight decay; ``params``: the module's tensors)."""
        raise NotImplementedError

    def parameter_reads(self) -> ParameterReads:
        """Full views of a parameter's gradient, optimizer state and fp32 value, whatever the partitioning."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward (the last one of an optimizer step reduces the gradients)."""
        raise NotImplementedError

    def step(self) -> StepOutcome:
        """Finish the optimizer step after ``grad_accum`` backwards; its outcome: grad_norm, lr, skipped."""
        raise NotImplementedError

    def skip_step(self, boundary_loss: torch.Tensor) -> StepOutcome:
        """End this optimizer step without an update (every rank calls it; a non-finite loss was seen):
        weights, optimizer state and LR stay as they were, accumulated gradients are dropped."""
        raise NotImplementedError

    def save(self, path: Path) -> None:
        """Model, optimizer, scheduler (and ZeRO partitions) into ``path/engine`` — every rank calls it."""
        raise NotImplementedError

    def load(self, path: Path, saved: dict[str, Any]) -> None:
        """Restore from ``path/engine``; ``saved`` is the checkpoint's trainer state (world size, ZeRO stage)."""
        raise NotImplementedError


class DDPEngine(Engine):
    """accelerate DDP + a torch optimizer; autocast for bf16/fp16, ``GradScaler`` loss scaling for fp16."""

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, cfg: RunConfig):
        super().__init__(accelerator, model, optimizer, scheduler, cfg)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
        self.autocast = torch.autocast(self.device.type, dtype=dtype) if dtype is not None else None
        # Dynamic loss scaling (Micikevicius et al. 2018): start at 2^16, halve on overflow, double after
        # 2000 clean steps -- torch's defaults, DeepSpeed's fp16 section uses the same start.
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=2.0**16) if self.fp16 else None
        # a NaN loss would lower the fp16 loss scale through the scaler's overflow path: the loop reads it first
        self.loss_check_on_device = self.scaler is None
        # torch's fused Adam(W) takes GradScaler's ``found_inf`` flag and skips the update on the device
        self.device_skip = self.scaler is None and getattr(self._torch_optimizer(), "_step_supports_amp_scaling", False)

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        if self.autocast is not None:
            with self.autocast:
                return self.model(**inputs)
        return self.model(**inputs)

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The innermost ``torch.optim.Optimizer`` (accelerate wraps it; its ``.optimizer`` is the real one)."""
        optimizer = self.optimizer
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        return optimizer

    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        return self._torch_optimizer().param_groups

    def parameter_reads(self) -> ParameterReads:
        """Whole tensors on every rank: ``p.grad`` (all-reduced after the boundary backward), ``optimizer.state[p]``."""
        state = self._torch_optimizer().state
        return ParameterReads(lambda p: p.grad, lambda p: state.get(p), lambda p: p)

    def backward(self, loss: torch.Tensor) -> None:
        self._micro += 1
        loss = loss / self.grad_accum
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        boundary = self._micro % self.grad_accum == 0
        if boundary or not hasattr(self.model, "no_sync"):
            self.accelerator.backward(loss)
        else:
            with self.model.no_sync():
                self.accelerator.backward(loss)

    def step(self) -> StepOutcome:
        """Clip and step; a non-finite gradient norm (identical on every rank: the gradients are
        all-reduced) skips the update. Under fp16 the scaler unscales first and, on an overflow,
        lowers the scale: routine, so the norm is reported as None, not as a health alarm."""
        self.settle()  # the previous step's LR schedule step, before this update uses the LR
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        if self.device_skip:
            return self._step_on_the_device(norm)
        norm = float(norm)  # the step's one host read here: the update waits on it
        skipped = not math.isfinite(norm)
        out: dict[str, Any] = {}
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.get_scale())  # the scale these gradients were computed with
            self.scaler.step(self.optimizer)  # skips the update itself when unscale_ found inf/NaN
            self.scaler.update()
            if skipped:
                norm = None
        elif not skipped:
            self.optimizer.step()
        applied_lr = self.lr()  # the step's own rate; the schedule then moves on to the next step's
        if not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome({"grad_norm": float(norm) if norm is not None else None, "lr": applied_lr, "skipped": skipped, **out})

    def _step_on_the_device(self, norm: torch.Tensor) -> StepOutcome:
        """The update with the skip decided on the device: the fused kernel reads ``found_inf`` (1 when the
        norm is non-finite) and leaves weights, moments and its step count as they were -- what a skipped
        step does, without the host waiting for the norm. ``settle`` reads the norm later (the next
        ``step()``, or whoever asks the outcome) and steps the LR schedule if the update was applied."""
        with skipped_if(self._torch_optimizer(), ~torch.isfinite(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._read_later(HostCopy(norm.detach().reshape(1).to(torch.float64)))

    def skip_step(self, boundary_loss: torch.Tensor) -> StepOutcome:
        self.settle()
        self._micro += 1
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome({"grad_norm": None, "lr": self.lr(), "skipped": True})

    def save(self, path: Path) -> None:
        self.settle()  # the LR schedule's position includes the last step
        if self.rank == 0:
            (path / "engine").mkdir(parents=True, exist_ok=True)
            torch.save(self.module.state_dict(), path / "engine" / "model.pt")
            torch.save(self.optimizer.state_dict(), path / "engine" / "optimizer.pt")
            if self.scaler is not None:
                torch.save(self.scaler.state_dict(), path / "engine" / "grad_scaler.pt")
        self._save_scheduler(path)

    def load(self, path: Path, saved: dict[str, Any]) -> None:
        """Model and optimizer state are whole on every rank, so any world size loads them. Every file
        goes through ``safe_torch_load`` (``weights_only=True``, a clear error naming the file)."""
        from models.safe_load import safe_torch_load

        e = path / "engine"
        where = "cpu" if self.device.type == "cpu" else self.device  # torch.load cannot map to "cpu:0" (multi-CPU accelerate)
        self.module.load_state_dict(safe_torch_load(e / "model.pt", map_location=where))
        self.optimizer.load_state_dict(safe_torch_load(e / "optimizer.pt", map_location=where))
        if self.scaler is not None and (e / "grad_scaler.pt").is_file():
            self.scaler.load_state_dict(safe_torch_load(e / "grad_scaler.pt"))
        self._load_scheduler(path)


class DeepSpeedEngine(Engine):
    """A DeepSpeed engine (ZeRO 0-3, its own bf16/fp16 optimizers); our LambdaLR is stepped here."""

    deepspeed = True
    reads_are_collective = True  # safe_get_full_* gather ZeRO partitions
    grads_before_step = False  # backward() applies the update at the accumulation boundary

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, cfg: RunConfig):
        super().__init__(accelerator, model, optimizer, scheduler, cfg)
        self.zero_stage = cfg.distributed.zero_stage
        self.world_free = cfg.distributed.world_free_checkpoints and self.zero_stage >= 1
        # the identities on a world of one removed (one_rank.py), the ZeRO step without host waits on any (zero_step.py);
        # distributed.one_rank_fast_path=false (one rank) or zero_step_on_device=false (more): stock DeepSpeed
        d = cfg.distributed
        self.patches = (one_rank_fast_path_(model, d.zero_step_on_device) if self.world_size == 1 and d.one_rank_fast_path
                        else zero_step_on_device_(model) if self.world_size > 1 and d.zero_step_on_device else [])
        # ZeRO-1/2 drop a step with non-finite gradients in their overflow check (bf16: unless the user's
        # JSON turned it off); fp16 would also lower its loss scale on a NaN loss: the loop reads it first
        zero_opt = getattr(model, "optimizer", None)
        self.loss_check_on_device = bool(
            not self.fp16 and self.zero_stage in (1, 2) and getattr(zero_opt, "compute_grad_norm", False)
            and (getattr(zero_opt, "dtype", None) != torch.bfloat16 or getattr(zero_opt, "check_grad_overflow", False)))

    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        zero_opt = getattr(self.model, "optimizer", None)
        return zero_opt.param_groups if zero_opt is not None else []

    def parameter_reads(self) -> ParameterReads:
        return ParameterReads(**deepspeed_getters(getattr(self.model, "optimizer", None)))

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed scales by 1/accum and applies the update at the accumulation boundary itself."""
        self.settle()  # the previous step's LR schedule step, before an update uses the LR
        self._micro += 1
        self.model.backward(loss)
        self.model.step()

    def step(self) -> StepOutcome:
        """DeepSpeed's ZeRO and bf16/fp16 optimizers drop a step with non-finite gradients (their
        overflow check); under fp16 that is a loss-scale overflow, routine, so the norm is None. Under
        ZeRO-1/2 with the fused optimizer the check is on the device (``zero_step``): the norm is read later."""
        pending = device_step(self.model)
        if pending is not None:
            return self._read_later(pending)
        norm = host_grad_norm(self.model)  # read before the update (zero_step.py), else DeepSpeed's
        skipped = not self.model.was_step_applied()
        if skipped and self.fp16:
            norm = None
        applied_lr = self.lr()  # the step's own rate; the schedule then moves on to the next step's
        if not skipped:  # accelerate hands DeepSpeed only its own scheduler types: we step ours
            self.scheduler.step()
        out: dict[str, Any] = {}
        if self.fp16:
            scale = getattr(self.model.optimizer, "cur_scale", None) or getattr(self.model.optimizer, "loss_scale", None)
            if isinstance(scale, (int, float)):
                out["loss_scale"] = float(scale)
        # DeepSpeed reports no norm for ZeRO-0 fp32 (it clips inside torch): None, not a NaN health alarm.
        return StepOutcome({"grad_norm": float(norm) if norm is not None else None, "lr": applied_lr, "skipped": skipped, **out})

    def _count_skipped(self) -> None:
        self.model.skipped_steps += 1  # DeepSpeed's own count, as its overflow path keeps it

    def skip_step(self, boundary_loss: torch.Tensor) -> StepOutcome:
        """ZeRO / bf16 / fp16 optimizers keep accumulated gradients in their own partitioned buffers,
        so the step is handed to their overflow path (the one fp16 loss scaling uses): a NaN gradient
        at the accumulation boundary makes them clear every buffer, count a skipped step and leave
        parameters and moments alone. ZeRO-0 fp32 has plain gradients on the parameters."""
        self.settle()
        if self.model.zero_optimization() or self.model.bfloat16_enabled() or self.fp16:
            self.backward(boundary_loss * float("nan"))
            if self.model.was_step_applied():  # only if the user's JSON turned DeepSpeed's overflow check off
                raise RuntimeError("DeepSpeed applied an optimizer step with NaN gradients (its overflow check is off: "
                                   "zero_optimization.compute_grad_norm / bf16.check_grad_overflow). Re-enable it and "
                                   "resume from the last checkpoint.")
        else:
            self._micro += 1
            self.model.zero_grad()
            self.model.micro_steps += 1
            self.model.global_steps += 1
            self.model.skipped_steps += 1
        return StepOutcome({"grad_norm": None, "lr": self.lr(), "skipped": True})

    def save(self, path: Path) -> None:
        self.settle()
        self.model.save_checkpoint(str(path), tag="engine", save_latest=False)
        if self.world_free:
            save_world_free(self, path)
        self._save_scheduler(path)

    def load(self, path: Path, saved: dict[str, Any]) -> None:
        """The ZeRO partitions through DeepSpeed's loader when this run has the world size and stage that
        wrote them, else from the checkpoint's world-size-free copy (``reshard``). DeepSpeed's own loaders
        run under ``weights_only_loads`` (no pickle of arbitrary objects)."""
        from models.safe_load import CheckpointError, weights_only_loads

        was = (saved.get("world_size"), saved.get("zero_stage"))
        same_layout = was == (self.world_size, self.zero_stage) or was[1] == self.zero_stage == 0  # ZeRO-0: whole state
        if not same_layout:
            if not (path / "engine" / WORLD_FREE_DIR / "meta.json").is_file():
                raise CheckpointError(
                    f"{path} was written on {was[0]} ranks with ZeRO-{was[1]} and holds no world-size-free copy "
                    f"(engine/{WORLD_FREE_DIR}: distributed.world_free_checkpoints was off, or an older version wrote "
                    f"it); this run has {self.world_size} ranks with ZeRO-{self.zero_stage}. Resume it on {was[0]} "
                    f"ranks with distributed.zero_stage={was[1]}.")
            load_world_free(self, path)
            self._load_scheduler(path)
            return
        with weights_only_loads():
            loaded, _ = self.model.load_checkpoint(str(path), tag="engine", load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no engine state under {path / 'engine'}; the checkpoint is incomplete.")
        self._load_scheduler(path)


def _drop_accelerate_deepspeed_env() -> None:
    """The DeepSpeed fields ``accelerate launch --config_file`` exports were folded into the run config
    (``distributed.load_launched_config``); they are dropped here so that accelerate does not build a
    second, conflicting DeepSpeed config from them (it would refuse the mix)."""
    for k in list(os.environ):
        if k.startswith("ACCELERATE_DEEPSPEED_") or k in ("ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_USE_DEEPSPEED"):
            del os.environ[k]


#: What DeepSpeed prints (with print(), on every rank) when it loads its CPU shared-memory collectives.
_DS_OP_BUILT = re.compile(r"^DeepSpeed \S+ built successfully\n?$")


@contextlib.contextmanager
def _joining_quietly() -> Iterator[None]:
    """Around ``Accelerator(...)``, which joins the process group (and DeepSpeed's comm backend):

    - ``OMP_NUM_THREADS`` is the thread count this process already runs with (a sweep's ``threads``,
      a launcher's setting), so accelerate neither replaces it (cores / local ranks) nor warns that it
      is unset; the variable is put back afterwards;
    - DeepSpeed's "op built successfully" line is dropped; everything else it prints is passed on.
    """
    had = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = had or str(torch.get_num_threads())
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        if had is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        sys.stdout.write("".join(line for line in out.getvalue().splitlines(keepends=True) if not _DS_OP_BUILT.match(line)))
        sys.stdout.flush()


def build_engine(cfg: RunConfig, env: DistEnv, model: torch.nn.Module, optimizer: Any, schedule_fn: Any) -> Engine:
    """Accelerator (+ DeepSpeed plugin) around model/optimizer/LR schedule; joins the process group.

    DeepSpeed gets an explicit process-group backend: accelerate 1.x only picks one for DeepSpeed when
    it sees an accelerator device, so on CPU it would report a world of one although DeepSpeed joined
    all ranks. ``InitProcessGroupKwargs(backend="gloo")`` makes accelerate and DeepSpeed agree.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    d = cfg.distributed
    pg = InitProcessGroupKwargs(backend=group_backend(d, env), timeout=datetime.timedelta(minutes=d.timeout_minutes))
    _drop_accelerate_deepspeed_env()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_fn)
    if d.engine == "deepspeed":
        os.environ.pop("ACCELERATE_USE_CPU", None)  # forcing cpu=True would disable DeepSpeed in accelerate
        mp = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[cfg.train.precision]
        param_numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        ds_json = deepspeed_config(cfg, env.world_size, param_numel)
        plugin = DeepSpeedPlugin(hf_ds_config=ds_json)
        with _joining_quietly():
            # DeepSpeed accumulates (its JSON's gradient_accumulation_steps); accelerate is told the same, so that it
            # does not warn of a mismatch with its own default of 1 and then take DeepSpeed's value anyway
            acc = Accelerator(deepspeed_plugin=plugin, mixed_precision=mp, kwargs_handlers=[pg],
                              gradient_accumulation_steps=cfg.train.grad_accum_steps)
        model, optimizer = acc.prepare(model, optimizer)  # our LambdaLR is stepped by DeepSpeedEngine.step
        engine: Engine = DeepSpeedEngine(acc, model, optimizer, scheduler, cfg)
        if cfg.model.compile:
            kwargs = compile_kwargs(cfg)
            compile_blocks_if(one_graph_per_block(cfg, env.world_size, ds_json["zero_optimization"]["overlap_comm"]),
                              model.module, cfg, kwargs)
            model.compile(compile_kwargs=kwargs)
        return engine
    # DDP: mixed precision is ours (DDPEngine's autocast + GradScaler), not accelerate's
    with _joining_quietly():
        acc = Accelerator(cpu=env.device == "cpu", mixed_precision="no", kwargs_handlers=[pg])
    if cfg.model.compile:
        kwargs = compile_kwargs(cfg)
        compile_blocks_if(one_graph_per_block(cfg, env.world_size, False), model, cfg, kwargs)
        model = torch.compile(model, **kwargs)
    model, optimizer = acc.prepare(model, optimizer)  # the raw LambdaLR steps once per optimizer step
    if d.one_rank_fast_path:
        model = unwrap_one_rank_ddp(acc, model)
    return DDPEngine(acc, model, optimizer, scheduler, cfg)

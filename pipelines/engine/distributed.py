"""Process topology, accelerate/DeepSpeed setup and job launch: the only reader of env/SLURM variables.

One code path serves 1 CPU process, N CPU processes (gloo), 1 GPU, 8 GPUs and N nodes:

- ``init_env()`` fills ``RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*`` for a plain ``python`` run (a world
  of one) and for ``srun`` (from ``SLURM_*``); torchrun, ``accelerate launch`` and ``deepspeed``
  set them already.
- ``build_engine()`` creates the ``Accelerator``. With ``engine: deepspeed`` it passes a
  ``DeepSpeedPlugin`` built from *our* config (``deepspeed_config``) and an explicit process-group
  backend: accelerate 1.x only picks a backend for DeepSpeed when it sees an accelerator device,
  so on CPU it would report a world of one although DeepSpeed joined all ranks. Passing
  ``InitProcessGroupKwargs(backend="gloo")`` makes accelerate and DeepSpeed agree. The DeepSpeed
  fields that ``accelerate launch --config_file`` exports (``ACCELERATE_DEEPSPEED_*``) are dropped:
  the run config is the single source of truth (accelerate would otherwise refuse the mix).
- ``Engine`` is what the training loop talks to: forward, backward, step, save, load.
- ``launch()`` starts the multi-process job as a subprocess.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import ConfigError
from pipelines.engine.config import RunConfig

__all__ = ["DistEnv", "init_env", "validate", "deepspeed_config", "build_engine", "Engine", "launch", "trace_dir", "free_port"]

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str
    device: str  # "cuda" or "cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_master() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodes:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodes.split(",")[0].split("[")[0]


def init_env() -> DistEnv:
    """Make the torch.distributed env variables complete for whatever launched us; return the topology."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "accelerate" if "ACCELERATE_MIXED_PRECISION" in env else ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed/env")
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        launcher = "srun"
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", _slurm_master())
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    else:
        launcher = "python"
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"] if launcher == "python" else env.get("LOCAL_WORLD_SIZE", "1"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), launcher, device)


def trace_dir() -> str | None:
    """``PRETRAIN_TRACE_DIR``: when set, each rank appends its per-step loss and sample keys there (tests)."""
    return os.environ.get("PRETRAIN_TRACE_DIR") or None


def validate(cfg: RunConfig, env: DistEnv) -> None:
    """Refuse impossible settings before any process group starts (ConfigError names the fix)."""
    d, t = cfg.distributed, cfg.train
    if d.engine == "ddp" and (d.offload_optimizer or d.offload_params):
        raise ConfigError("distributed.offload_optimizer/offload_params need engine=deepspeed (ZeRO-Offload); plain DDP cannot offload.")
    if d.engine == "deepspeed" and d.zero_stage == 3 and cfg.model.compile:
        raise ConfigError(
            "model.compile=true is not supported with distributed.zero_stage=3 in this engine (ZeRO-3 gathers parameters "
            "with module hooks that torch.compile graph-breaks on). Use zero_stage<=2 or compile=false."
        )
    if d.offload_params and d.zero_stage != 3:
        raise ConfigError("distributed.offload_params needs distributed.zero_stage=3.")
    if d.offload_optimizer and d.zero_stage == 0:
        raise ConfigError("distributed.offload_optimizer needs distributed.zero_stage >= 1 (ZeRO-Offload partitions the optimizer).")
    if t.precision == "fp16" and env.device == "cpu":
        raise ConfigError("train.precision=fp16 needs a GPU (CPU kernels have no fp16 training path). Use bf16 or fp32 on CPU.")
    if d.backend == "nccl" and env.device == "cpu":
        raise ConfigError("distributed.backend=nccl needs GPUs; use auto or gloo on CPU.")
    if cfg.data.micro_batch_size < 1:
        raise ConfigError(f"data.micro_batch_size must be >= 1, got {cfg.data.micro_batch_size}.")
    if cfg.optim.name == "lamb" and d.engine == "deepspeed" and d.zero_stage >= 1:
        warnings.warn("optim.name=lamb with distributed.zero_stage>=1: DeepSpeed hands the optimizer flat fp32 partitions, "
                      "so LAMB's trust ratio is computed per (parameter group, rank partition), not per layer as in "
                      "You et al. 2020. Use zero_stage=0 (or engine=ddp) for the per-layer ratio.", stacklevel=2)
    if d.deepspeed_config:
        ds = deepspeed_config(cfg, env.world_size)  # raises on disagreement with the base JSON
        tb = ds.get("train_batch_size")
        if tb != cfg.data.micro_batch_size * t.grad_accum_steps * env.world_size:
            raise ConfigError(
                f"{d.deepspeed_config}: train_batch_size={tb} != micro_batch_size {cfg.data.micro_batch_size} x "
                f"grad_accum_steps {t.grad_accum_steps} x world size {env.world_size}. Set it to \"auto\"."
            )


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON for this run: our fields, on top of ``distributed.deepspeed_config`` if given."""
    from pipelines.engine.optim import deepspeed_optimizer_fields

    d, t = cfg.distributed, cfg.train
    zero: dict[str, Any] = {"stage": d.zero_stage, "contiguous_gradients": True, "overlap_comm": torch.cuda.is_available()}
    if d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if d.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    ours: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": cfg.data.micro_batch_size * t.grad_accum_steps * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **deepspeed_optimizer_fields(cfg.optim, offload=d.offload_optimizer),
    }
    if not d.deepspeed_config:
        return ours
    path = Path(d.deepspeed_config)
    try:
        base = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"distributed.deepspeed_config={path} cannot be read as JSON ({exc}). Fix the path or the file.") from None
    if "optimizer" in base or "scheduler" in base:
        raise ConfigError(f"{path}: remove its `optimizer`/`scheduler` sections; optim.* and schedule.* build them.")

    tuning = {"steps_per_print", "wall_clock_breakdown", "overlap_comm", "contiguous_gradients", "pin_memory",
              "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale", "loss_scale"}

    def merge(b: dict, o: dict, where: str) -> dict:
        out = dict(b)  # keys only the JSON has (bucket sizes, prefetch, ...) are kept as they are
        for k, v in o.items():
            if isinstance(v, dict) and isinstance(b.get(k), dict):
                out[k] = merge(b[k], v, f"{where}{k}.")
            elif k in b and b[k] != "auto" and b[k] != v:
                if k in tuning or k == "train_batch_size":  # the JSON's tuning wins; batch is checked in validate()
                    continue
                raise ConfigError(
                    f"{path}: `{where}{k}` is {b[k]!r} but the run config gives {v!r}. Set it to \"auto\" in the JSON "
                    f"(the run config fills it) or change the run config to match (e.g. distributed.zero_stage)."
                )
            else:
                out[k] = v
        return out

    merged = merge(base, ours, "")
    zero = merged.get("zero_optimization", {})
    for key, flag in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        if zero.get(key, {}).get("device", "none") != "none" and not getattr(d, flag):
            raise ConfigError(f"{path} offloads ({key}) but distributed.{flag} is false. Set distributed.{flag}=true "
                              f"(the optimizer is built for it) or remove `{key}` from the JSON.")

    def leftover(node: Any, where: str) -> None:
        for k, v in (node.items() if isinstance(node, dict) else []):
            if v == "auto":
                raise ConfigError(f"{path}: `{where}{k}` is \"auto\" but the run config has no value for it. Give it a value.")
            leftover(v, f"{where}{k}.")

    leftover(merged, "")
    return merged


class Engine:
    """The wrapped model as the loop sees it: ``engine(**inputs)``, ``backward``, ``step``, ``save``, ``load``."""

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any, cfg: RunConfig):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.deepspeed = cfg.distributed.engine == "deepspeed"
        self.grad_accum, self.grad_clip = cfg.train.grad_accum_steps, cfg.optim.grad_clip
        self.module = model.module if hasattr(model, "module") else model
        self.module = getattr(self.module, "_orig_mod", self.module)  # torch.compile wrapper (ddp engine)
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.device = accelerator.device
        self._micro = 0
        self.fp16 = cfg.train.precision == "fp16"
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if (
            not self.deepspeed and cfg.train.precision == "bf16") else None

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        if self.autocast is not None:
            with self.autocast:
                return self.model(**inputs)
        return self.model(**inputs)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward; DeepSpeed scales by 1/accum and steps at the boundary itself."""
        self._micro += 1
        if self.deepspeed:
            self.model.backward(loss)
            self.model.step()
            return
        boundary = self._micro % self.grad_accum == 0
        if boundary or not hasattr(self.model, "no_sync"):
            self.accelerator.backward(loss / self.grad_accum)
        else:
            with self.model.no_sync():
                self.accelerator.backward(loss / self.grad_accum)

    def step(self) -> dict[str, float]:
        """Finish the optimizer step after ``grad_accum`` backwards; returns grad_norm, lr, skipped.

        A step whose gradient norm is non-finite is not applied (``skipped``): DeepSpeed's ZeRO and
        bf16/fp16 optimizers drop it themselves (their overflow check), the DDP path checks the norm
        it computes for clipping (identical on every rank: the gradients are all-reduced).
        """
        if self.deepspeed:
            norm = self.model.get_global_grad_norm()
            skipped = not self.model.was_step_applied()
            if skipped and self.fp16:  # a loss-scale overflow: DeepSpeed lowers the scale and goes on
                norm = None  # (routine under fp16, not a health alarm)
            if not skipped:  # accelerate hands DeepSpeed only its own scheduler types: we step ours
                self.scheduler.step()
        else:
            params = [p for p in self.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else float("inf"))
            skipped = not bool(torch.isfinite(norm))
            if not skipped:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.optimizer.param_groups[0]["lr"])
        # DeepSpeed reports no norm for ZeRO-0 fp32 (it clips inside torch): None, not a NaN health alarm.
        return {"grad_norm": float(norm) if norm is not None else None, "lr": lr, "skipped": skipped}

    def skip_step(self, boundary_loss: torch.Tensor) -> dict[str, float]:
        """End this optimizer step without an update (every rank calls it; a non-finite loss was seen).

        Instead of the last micro-batch's backward: weights, optimizer state and LR schedule stay as
        they were, the gradients accumulated by the earlier micro-batches are dropped, and the
        micro-step bookkeeping stays aligned. DeepSpeed's ZeRO / bf16 / fp16 optimizers keep
        accumulated gradients in their own partitioned buffers, so the step is handed to their
        overflow path (the one fp16 loss scaling uses): a NaN gradient at the accumulation boundary
        makes them clear every buffer, count a skipped step and leave parameters and moments alone.
        """
        if self.deepspeed and (self.model.zero_optimization() or self.model.bfloat16_enabled() or self.fp16):
            self.backward(boundary_loss * float("nan"))
            if self.model.was_step_applied():  # only if the user's JSON turned DeepSpeed's overflow check off
                raise RuntimeError("DeepSpeed applied an optimizer step with NaN gradients (its overflow check is off: "
                                   "zero_optimization.compute_grad_norm / bf16.check_grad_overflow). Re-enable it and "
                                   "resume from the last checkpoint.")
        elif self.deepspeed:  # ZeRO-0 fp32: plain gradients on the parameters, DeepSpeed counts micro-steps
            self._micro += 1
            self.model.zero_grad()
            self.model.micro_steps += 1
            self.model.global_steps += 1
            self.model.skipped_steps += 1
        else:
            self._micro += 1
            self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": None, "lr": float(self.optimizer.param_groups[0]["lr"]), "skipped": True}

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if torch.distributed.is_initialized() and self.world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` in rank order (all ranks must call it)."""
        if not (torch.distributed.is_initialized() and self.world_size > 1):
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, t)
        return torch.cat(parts)

    def barrier(self) -> None:
        if torch.distributed.is_initialized() and self.world_size > 1:
            torch.distributed.barrier()

    def save(self, path: Path) -> None:
        """Model, optimizer, scheduler (and ZeRO partitions) into ``path/engine`` — every rank calls it."""
        if self.deepspeed:
            self.model.save_checkpoint(str(path), tag="engine", save_latest=False)
        elif self.rank == 0:
            (path / "engine").mkdir(parents=True, exist_ok=True)
            torch.save(self.module.state_dict(), path / "engine" / "model.pt")
            torch.save(self.optimizer.state_dict(), path / "engine" / "optimizer.pt")
        if self.rank == 0:
            (path / "engine").mkdir(parents=True, exist_ok=True)
            torch.save(self.scheduler.state_dict(), path / "engine" / "lr_scheduler.pt")

    def load(self, path: Path) -> None:
        """Every file goes through ``safe_load`` (``weights_only=True``, DeepSpeed's loaders included)."""
        from pipelines.engine.safe_load import CheckpointError, safe_torch_load, weights_only_loads

        e = path / "engine"
        if self.deepspeed:
            with weights_only_loads():
                loaded, _ = self.model.load_checkpoint(str(path), tag="engine", load_optimizer_states=True,
                                                       load_lr_scheduler_states=False)
            if loaded is None:
                raise CheckpointError(f"DeepSpeed found no engine state under {e}; the checkpoint is incomplete.")
        else:
            where = "cpu" if self.device.type == "cpu" else self.device  # torch.load cannot map to "cpu:0" (multi-CPU accelerate)
            self.module.load_state_dict(safe_torch_load(e / "model.pt", map_location=where))
            self.optimizer.load_state_dict(safe_torch_load(e / "optimizer.pt", map_location=where))
        self.scheduler.load_state_dict(safe_torch_load(e / "lr_scheduler.pt"))


def build_engine(cfg: RunConfig, env: DistEnv, model: torch.nn.Module, optimizer: Any, schedule_fn: Any) -> Engine:
    """Accelerator (+ DeepSpeed plugin) around model/optimizer/LR schedule; joins the process group."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    d = cfg.distributed
    backend = d.backend if d.backend != "auto" else ("nccl" if env.device == "cuda" else "gloo")
    pg = InitProcessGroupKwargs(backend=backend, timeout=datetime.timedelta(minutes=d.timeout_minutes))
    stage_env = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage_env is not None and d.engine == "deepspeed" and int(stage_env) != d.zero_stage and env.rank == 0:
        log.info("accelerate config says ZeRO stage %s; the run config's distributed.zero_stage=%d wins.", stage_env, d.zero_stage)
    for k in list(os.environ):
        if k.startswith("ACCELERATE_DEEPSPEED_") or k in ("ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_USE_DEEPSPEED"):
            del os.environ[k]
    mp = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[cfg.train.precision]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_fn)
    if d.engine == "deepspeed":
        os.environ.pop("ACCELERATE_USE_CPU", None)  # forcing cpu=True would disable DeepSpeed in accelerate
        plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(cfg, env.world_size))
        acc = Accelerator(deepspeed_plugin=plugin, mixed_precision=mp, kwargs_handlers=[pg])
        model, optimizer = acc.prepare(model, optimizer)  # our LambdaLR is stepped by Engine.step
        engine = Engine(acc, model, optimizer, scheduler, cfg)
        if cfg.model.compile:
            model.compile()
        return engine
    acc = Accelerator(cpu=env.device == "cpu", mixed_precision="no", kwargs_handlers=[pg])
    if cfg.model.compile:
        model = torch.compile(model)
    model, optimizer = acc.prepare(model, optimizer)  # the raw LambdaLR steps once per optimizer step
    return Engine(acc, model, optimizer, scheduler, cfg)


@contextlib.contextmanager
def in_process_run(threads: int = 0) -> Iterator[None]:
    """Run a training job inside the caller's process and leave its global state as it found it.

    A run installs signal handlers, may switch torch to deterministic kernels or change its thread
    count, creates accelerate's process-wide state and a process group. The demo, sweeps, notebooks
    and tests run several jobs in one process, so all of that is undone afterwards.
    """
    import faulthandler
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    deterministic, num_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        faulthandler.unregister(signal.SIGUSR2)  # the run's stack dump on SIGUSR2 (pipelines.loading.workers)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(num_threads)
        try:  # the next run builds a fresh Accelerator (its state is a process-wide singleton)
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(True)
        except Exception:  # noqa: BLE001 - accelerate missing or changed: nothing to reset
            pass
        if owns_group and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            _forget_deepspeed_groups()


def _forget_deepspeed_groups() -> None:
    """DeepSpeed caches process groups module-wide; once the group is destroyed the next in-process
    run would broadcast over a dead one ("group is not registered")."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                 "_TENSOR_MODEL_PARALLEL_GROUP", "mesh_device"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()


def barrier_if_initialized() -> None:
    """Wait for every rank when a process group exists (outside the engine, e.g. around rank-0 file work)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def fresh_world_env() -> dict[str, str]:
    """This process' environment minus the rendezvous variables of a world it is or was part of.

    `init_env()` writes them into os.environ for in-process runs; a job started from here is a new
    world and must not inherit them (the old MASTER_PORT may still be bound by this process).
    """
    return {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARS}


def launch(config_path: str, overrides: list[str], num_processes: int, *, launcher: str = "accelerate",
           accelerate_config: str | None = None, extra_env: dict[str, str] | None = None,
           module: str = "pipelines.pretrain") -> int:
    """Run ``python -m pipelines.pretrain CONFIG overrides`` on ``num_processes`` local processes; return its exit code.

    ``launcher``: ``accelerate`` (``--config_file`` defaults to configs/accelerate/cpu_zero2.yaml on CPU,
    multi_gpu.yaml on GPU), ``torchrun``, ``deepspeed`` or ``python`` (one process). Output streams to
    this process's stdout/stderr.
    """
    bindir = Path(sys.executable).parent
    port = str(free_port())
    target = ["-m", module, str(config_path), *overrides]
    if launcher == "accelerate":
        acfg = accelerate_config or str(REPO / "configs/accelerate" / ("multi_gpu.yaml" if torch.cuda.is_available() else "cpu_zero2.yaml"))
        exe = str(bindir / "accelerate") if (bindir / "accelerate").exists() else (shutil.which("accelerate") or "accelerate")
        cmd = [exe, "launch", "--config_file", acfg, "--num_processes", str(num_processes), "--num_machines", "1",
               "--main_process_port", port, *target]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes), "--master_port", port, *target]
    elif launcher == "deepspeed":
        exe = str(bindir / "deepspeed") if (bindir / "deepspeed").exists() else (shutil.which("deepspeed") or "deepspeed")
        cmd = [exe, "--num_gpus", str(num_processes), "--master_port", port, "--module", *target[1:]]
    elif launcher == "python":
        if num_processes != 1:
            raise ConfigError("launcher=python runs one process; use accelerate, torchrun or deepspeed for more.")
        cmd = [sys.executable, *target]
    else:
        raise ConfigError(f"Unknown launcher {launcher!r}: choose accelerate, torchrun, deepspeed or python.")
    env = fresh_world_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, num_processes))))
    env.update(extra_env or {})
    proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()

"""Process topology, run validation, the DeepSpeed JSON and job launch: the only reader of env/SLURM variables.

One code path serves 1 CPU process, N CPU processes (gloo), 1 GPU, 8 GPUs and N nodes:

- ``init_env()`` fills ``RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*`` for a plain ``python`` run (a world
  of one) and for ``srun`` (from ``SLURM_*``); torchrun, ``accelerate launch`` and ``deepspeed``
  set them already.
- ``validate()`` refuses impossible settings (``check.check`` plus the device-specific ones);
  ``deepspeed_config()`` is the DeepSpeed JSON of a run. The engines themselves (DDP, DeepSpeed)
  and ``build_engine`` live in ``pipelines.engine.engines``.
- ``launch()`` starts the multi-process job as a subprocess (``pipelines.engine.launcher``, re-exported
  here; it imports no torch, so a launching process stays light).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import ConfigError
from pipelines.engine.check import ACCELERATE_PRECISION, zero_overlap
from pipelines.engine.config import DistributedConfig, RunConfig
from pipelines.engine.launcher import _RENDEZVOUS_VARS, free_port, launch, quiet_libraries
from pipelines.engine.registries import OPTIMIZERS

__all__ = ["DistEnv", "init_env", "validate", "deepspeed_config", "launch", "free_port", "in_process_run",
           "quiet_libraries", "group_backend", "join_process_group", "all_gather_json", "all_gather_bytes"]

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str
    device: str  # "cuda" or "cpu"


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
    quiet_libraries()
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


#: ``accelerate launch --config_file`` fields (as the environment variables it exports) -> run config keys.
_ACCELERATE_FIELDS = {
    "ACCELERATE_MIXED_PRECISION": ("mixed_precision", "train.precision"),
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": ("deepspeed_config.zero_stage", "distributed.zero_stage"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": ("deepspeed_config.offload_optimizer_device", "distributed.offload_optimizer"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": ("deepspeed_config.offload_param_device", "distributed.offload_params"),
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": ("deepspeed_config.deepspeed_config_file", "distributed.deepspeed_config"),
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("deepspeed_config.gradient_accumulation_steps", "train.grad_accum_steps"),
    "ACCELERATE_GRADIENT_CLIPPING": ("deepspeed_config.gradient_clipping", "optim.grad_clip"),
}


def accelerate_file_settings(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The settings of an ``accelerate launch --config_file`` file, as run config keys (dotted -> value).

    accelerate exports them to every rank as ``ACCELERATE_*`` variables. Fields we cannot honour
    raise ``ConfigError`` naming the run config key to use instead.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for var, (field, key) in _ACCELERATE_FIELDS.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        value: Any
        if var == "ACCELERATE_MIXED_PRECISION":
            value = ACCELERATE_PRECISION.get(raw.lower())
            if value is None:
                raise ConfigError(f"accelerate config: mixed_precision={raw} is not supported. Set it to no, bf16 or fp16 "
                                  f"there, or remove it and set train.precision in the run config.")
        elif var.endswith("_DEVICE"):
            if raw.lower() not in ("none", "cpu"):
                raise ConfigError(f"accelerate config: {field}={raw} is not supported (only cpu offload). Remove it from the "
                                  f"accelerate file and set {key}=true in the run config for CPU offload.")
            value = raw.lower() == "cpu"
        elif var == "ACCELERATE_DEEPSPEED_CONFIG_FILE":
            value = raw
        else:
            try:
                value = float(raw) if var == "ACCELERATE_GRADIENT_CLIPPING" else int(raw)
            except ValueError:
                raise ConfigError(f"accelerate config: {field}={raw!r} is not a number. Fix it there or move it to "
                                  f"{key} in the run config.") from None
        out[key] = value
    return out


def load_launched_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = (), *,
                         cls: type | None = None, environ: dict[str, str] | None = None) -> Any:
    """The run config of a launched rank: our defaults < the ``accelerate launch --config_file`` file's
    fields < the run config file < ``key=value`` overrides.

    The rule: the run config wins. A field the run config (file or override) leaves unset takes the
    accelerate file's value (INFO on rank 0); one it sets to another value keeps the run config's,
    with a WARNING on rank 0 naming both values. The resolved values end up in run_dir/config.yaml."""
    from core.config import apply_overrides, deep_merge, from_dict, load_yaml

    if cls is None:
        cls = RunConfig
    settings = accelerate_file_settings(environ)
    base: dict[str, Any] = apply_overrides({}, [f"{k}={v}" for k, v in settings.items()])
    data = load_yaml(path) if path else {}
    data = apply_overrides(deep_merge(base, data), list(overrides))
    cfg = from_dict(cls, data, source=str(path or "config"))
    if settings and int((environ or os.environ).get("RANK", "0")) == 0:
        for key, value in settings.items():
            section, name = key.split(".")
            final = getattr(getattr(cfg, section), name)
            field = next(f for var, (f, k) in _ACCELERATE_FIELDS.items() if k == key)
            if final == value:
                log.info("accelerate config file: %s applied as %s=%r.", field, key, value)
            else:
                log.warning("accelerate config file: %s gives %s=%r, but the run config sets %s=%r: the run config "
                            "wins. Set %s in the run config (or as an override) to use the other value, or remove "
                            "%s from the accelerate file.", field, key, value, key, final, key, field)
    return cfg


def validate(cfg: RunConfig, env: DistEnv) -> None:
    """Refuse impossible settings before any process group starts (ConfigError names the fix).

    ``check.check`` (torch-free, also run by the CLI and sweeps before launching) covers names,
    the schedule and batch arithmetic; this adds what depends on the device.
    """
    from pipelines.engine.check import ONE_RANK_ZERO3, batch_split, check

    check(cfg, world_size=env.world_size)
    d, t = cfg.distributed, cfg.train
    micro, accum, total = batch_split(cfg, env.world_size)
    if (micro, accum) != (cfg.data.micro_batch_size, t.grad_accum_steps):
        raise ConfigError(f"train.global_batch_size {total} on {env.world_size} rank(s) is data.micro_batch_size {micro} x "
                          f"train.grad_accum_steps {accum}, but this run was set up with {cfg.data.micro_batch_size} x "
                          f"{t.grad_accum_steps}. Split it before building the data sources: "
                          f"pipelines.engine.check.apply_batch_split(cfg, world_size), as open_run_data does.")
    if t.precision == "fp16" and env.device == "cpu" and d.engine == "deepspeed":
        raise ConfigError("train.precision=fp16 needs a GPU with engine=deepspeed (DeepSpeed's fp16 optimizer is CUDA-only). "
                          "Use bf16 or fp32 on CPU, or distributed.engine=ddp (torch autocast + GradScaler).")
    if d.backend == "nccl" and env.device == "cpu":
        raise ConfigError("distributed.backend=nccl needs GPUs; use auto or gloo on CPU.")
    if OPTIMIZERS.lookup(cfg.optim.name).layerwise and d.engine == "deepspeed" and d.zero_stage >= 1:
        warnings.warn(f"optim.name={cfg.optim.name} with distributed.zero_stage>=1: DeepSpeed hands the optimizer flat "
                      "fp32 partitions, so its per-layer norms (LAMB's trust ratio, You et al. 2020) are computed per "
                      "(parameter group, rank partition), not per layer. Use zero_stage=0 (or engine=ddp) for the "
                      "per-layer ratio.", stacklevel=2)
    if d.engine == "deepspeed" and d.zero_stage == 3 and env.world_size == 1 and not d.offload_params:
        log.warning(ONE_RANK_ZERO3)
    if d.deepspeed_config:
        deepspeed_config(cfg, env.world_size)  # raises on a disagreement with the base JSON



#: DeepSpeed's throughput timer is on by default and calls ``get_accelerator().synchronize()`` -- a full device
#: drain -- at every forward and every optimizer step, to time steps for a log line that ``steps_per_print``
#: never prints here (the trainer's ``ThroughputMeter`` times steps without waiting). Off, the host keeps
#: queueing the next step while the device runs this one.
QUIET_TIMERS: dict[str, Any] = {"throughput": {"enabled": False, "synchronized": False}}


def reduce_bucket_size(param_numel: int) -> int:
    """DeepSpeed's gradient bucket (``zero_optimization.reduce_bucket_size``), no larger than the model.

    ZeRO-1/2 allocate it with ``torch.empty`` on every micro-step (two with overlap_comm) and ZeRO-3 once;
    DeepSpeed's default is 5e8 elements whatever the model: 1.9 GiB in fp32 (0.9 in bf16) for a model of
    any size, and under ``train.deterministic`` torch fills every ``empty`` with NaN, so a tiny model's
    step wrote 2 GB (1.2 s instead of 0.05 s, 2 CPU ranks). A bucket that holds every gradient is filled
    and reduced exactly as the default one is for any model below 5e8 parameters: one bucket, reduced
    after backward, so the results are the same.
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return min(int(DeepSpeedZeroConfig.model_fields["reduce_bucket_size"].default), param_numel)


def overlap_comm(cfg: RunConfig, world_size: int, param_numel: int = 0, bucket: int = 0) -> bool:
    """DeepSpeed's ``overlap_comm``: under ZeRO-1/2 on only where it can overlap something.

    ZeRO-1/2 reduce each full gradient bucket on a side stream while backward goes on, and pay for that with a
    full device synchronize in every backward's epilogue (``independent_gradient_partition_epilogue``) and a
    second bucket. A bucket is reduced when the next gradient would overflow it, or after backward. So nothing
    overlaps on one rank (nothing to reduce), with a model no larger than one bucket (``bucket``, default
    ``reduce_bucket_size``: every model under DeepSpeed's 5e8 elements) and with the model compiled as one graph:
    its backward is one autograd node whose gradients all arrive, with their hooks, after its last kernel is queued
    (``torchrun --nproc_per_node 2 benchmarks/comm_overlap.py``, 2 CPU ranks); ``model.compile_regions`` auto then
    compiles block by block, which overlaps as eager does. Same results either way: overlap
    only changes which stream reduces. ZeRO-3 prefetches and reduces on its own streams with it: on, as before,
    on several GPUs. ``param_numel`` 0: the count is unknown.
    """
    return torch.cuda.is_available() and zero_overlap(cfg, world_size, param_numel, bucket or reduce_bucket_size(param_numel))[0]


def deepspeed_config(cfg: RunConfig, world_size: int, param_numel: int = 0) -> dict[str, Any]:
    """The DeepSpeed JSON for this run: our fields, on top of ``distributed.deepspeed_config`` if given.

    ``param_numel`` (the model's parameter count, known once it is built) sizes the gradient bucket
    (``reduce_bucket_size``); a JSON that sets the bucket keeps its own.
    """
    from pipelines.engine.optim import deepspeed_optimizer_fields

    d, t = cfg.distributed, cfg.train
    zero: dict[str, Any] = {"stage": d.zero_stage, "contiguous_gradients": True,
                            "overlap_comm": overlap_comm(cfg, world_size, param_numel)}
    if param_numel and d.zero_stage > 0:
        zero["reduce_bucket_size"] = reduce_bucket_size(param_numel)
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
        return {**ours, "timers": copy.deepcopy(QUIET_TIMERS)}
    path = Path(d.deepspeed_config)
    try:
        base = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"distributed.deepspeed_config={path} cannot be read as JSON ({exc}). Fix the path or the file.") from None
    if "optimizer" in base or "scheduler" in base:
        raise ConfigError(f"{path}: remove its `optimizer`/`scheduler` sections; optim.* and schedule.* build them.")

    tuning = {"steps_per_print", "wall_clock_breakdown", "overlap_comm", "contiguous_gradients", "pin_memory", "reduce_bucket_size",
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
    if (base.get("zero_optimization", {}).get("overlap_comm", "auto") == "auto"  # ours, for the JSON's own bucket
            and isinstance(zero.get("reduce_bucket_size"), (int, float))):
        zero["overlap_comm"] = overlap_comm(cfg, world_size, param_numel, int(zero["reduce_bucket_size"]))  # the JSON's bucket
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
    return {"timers": copy.deepcopy(QUIET_TIMERS), **merged}  # a `timers` section of the JSON wins


@contextlib.contextmanager
def in_process_run(threads: int = 0) -> Iterator[None]:
    """Run a training job inside the caller's process and leave its global state as it found it.

    A run installs signal handlers, may switch torch to deterministic kernels or change its thread
    count, writes its world (RANK, MASTER_PORT, ...) into os.environ, creates accelerate's process-wide
    state and a process group. The demo, sweeps, notebooks and tests run several jobs in one process
    (and start jobs from it, which would inherit a stale world), so all of that is undone afterwards -- including
    ZeRO-3's replacement of ``torch.nn.functional.linear`` (DeepSpeed: "persists unless manually
    reset"), which would otherwise route every later model's linear layers through its autograd wrapper.
    """
    import faulthandler
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    deterministic, num_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    linear = torch.nn.functional.linear
    rendezvous = {k: os.environ.get(k) for k in _RENDEZVOUS_VARS}
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
        torch.nn.functional.linear = linear
        for k, v in rendezvous.items():  # init_env() wrote this run's world (its MASTER_PORT) into os.environ
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
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
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and hasattr(comm, "cdb"):
        comm.cdb = None  # its backend holds the destroyed group (and its TCPStore, i.e. the port)
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


def group_backend(d: DistributedConfig, env: DistEnv) -> str:
    """The process-group backend of a run: ``distributed.backend``, or nccl on GPU and gloo on CPU."""
    return d.backend if d.backend != "auto" else ("nccl" if env.device == "cuda" else "gloo")


def join_process_group(d: DistributedConfig, env: DistEnv) -> None:
    """Join the job's process group before the engine exists, for work the ranks share before training (image
    fine-tuning splits its check of every image over them). ``build_engine``'s ``Accelerator`` and DeepSpeed take
    an initialized group as it is, so this is the group they would have made: same backend, timeout and device."""
    if env.world_size == 1 or torch.distributed.is_initialized():
        return
    if env.device == "cuda":
        torch.cuda.set_device(env.local_rank)  # what accelerate sets; NCCL's collectives run on it
    torch.distributed.init_process_group(backend=group_backend(d, env), init_method="env://", rank=env.rank,
                                         world_size=env.world_size, timeout=datetime.timedelta(minutes=d.timeout_minutes))


def all_gather_json(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order (all ranks call it; ``[obj]`` without a process group).
    JSON, not pickle: nothing a peer sends is unpickled (``all_gather_object`` would)."""
    parts = all_gather_bytes(json.dumps(obj).encode("utf-8"), env)
    return [json.loads(p.decode("utf-8")) for p in parts]


def all_gather_bytes(data: bytes, env: DistEnv) -> list[bytes]:
    """Every rank's ``data``, in rank order (all ranks call it; ``[data]`` without a process group).

    The bytes travel in uint8 tensors on the rank's device (NCCL gathers only GPU tensors), padded to the
    longest rank's length; the receiver decides how to read them (JSON, raw float32: never pickle)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or env.world_size == 1:
        return [data]
    device = torch.device("cuda", torch.cuda.current_device()) if env.device == "cuda" else torch.device("cpu")
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(env.world_size)]
    torch.distributed.all_gather(sizes, torch.tensor([len(data)], dtype=torch.long, device=device))
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=device)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(padded) for _ in lengths]
    torch.distributed.all_gather(parts, padded)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, lengths, strict=True)]

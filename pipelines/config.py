"""Typed configuration: one keyword-only dataclass per concern, loaded from YAML.

A run is described by a YAML file (which may ``extends:`` another, paths relative to the file)
plus ``key=value`` overrides with dotted paths (``optim.lr=3e-4``). Loading is strict: an
unknown key fails with the closest valid key suggested, a wrong type names the key, the expected
type and the value. The resolved config is written to every run directory (``save_config``) and
is enough to rebuild the run.

This module imports no torch so that ``data_prep`` and the CLI can use it cheaply.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "TrainConfig",
    "DistributedConfig",
    "LoggingConfig",
    "RunConfig",
    "load_config",
    "load_yaml",
    "apply_overrides",
    "from_dict",
    "to_dict",
    "save_config",
    "atomic_write_text",
    "describe",
]


class ConfigError(ValueError):
    """A configuration problem the user must fix; the CLI prints it and exits with code 2."""


def option(default: Any = dataclasses.MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field whose ``help`` text is its documentation (shown by ``describe``)."""
    if isinstance(default, (list, dict)):
        value = default
        kwargs["default_factory"] = lambda: type(value)(value)
        default = dataclasses.MISSING
    return field(default=default, metadata={"help": help}, **kwargs)


# --------------------------------------------------------------------------------------------
# The run configuration
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class DataConfig:
    """Where the training samples come from and how they are batched."""

    corpus: str = option("", help="Corpus directory written by `pretrain prepare` (has manifest.json).")
    micro_batch_size: int = option(32, help="Samples per process per forward pass.")
    num_workers: int = option(2, help="DataLoader worker processes per rank (0 = load in the main process).")
    shuffle_buffer: int = option(1000, help="Samples held in the per-worker shuffle buffer.")
    prefetch_factor: int = option(2, help="Batches prefetched per DataLoader worker.")
    worker_start_method: Literal["forkserver", "spawn", "fork"] = option(
        "forkserver", help="How DataLoader workers start: forkserver (safe, ~0.1 s each), spawn (~2 s each), or fork, "
                           "which can deadlock a worker of a multi-threaded trainer (see pipelines/workers.py).")
    mlm_probability: float = option(0.15, help="Share of non-special tokens selected for MLM (BERT: 0.15).")
    whole_word_masking: bool = option(False, help="Mask all WordPiece pieces of a selected word together.")
    image_size: int = option(224, help="Training crop size for image tasks.")
    mixup_alpha: float = option(0.0, help="Mixup Beta(alpha, alpha) for image tasks; 0 disables.")
    on_bad_sample: Literal["skip", "fail"] = option("skip", help="What to do with an undecodable sample.")
    verify_checksums: bool = option(True, help="Check every shard's sha256 against the manifest before training.")
    eval_split: str = option("validation", help="Manifest split used for periodic evaluation.")


@dataclass(kw_only=True)
class ModelConfig:
    """Which registered model to build (see `models.list_models()`)."""

    name: str = option("bert-tiny", help="Registry name, e.g. bert-tiny, bert-base, gpt-tiny, gpt2-small, vit-tiny.")
    overrides: dict[str, Any] = option({}, help="Fields of the model's own config to change, e.g. {num_layers: 4}.")
    activation_checkpointing: bool = option(False, help="Recompute block activations in backward to save memory.")
    compile: bool = option(False, help="Wrap the model with torch.compile.")


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer (see `pipelines.optim`)."""

    name: Literal["adam", "adamw", "radam", "lamb"] = option("adamw", help="Optimizer registry name.")
    lr: float = option(1e-3, help="Base (peak) learning rate; ignored by schedule.warmup=noam (Vaswani et al. eq. 3 sets it).")
    betas: list[float] = option([0.9, 0.999], help="Adam-family (beta1, beta2).")
    eps: float = option(1e-8, help="Adam-family epsilon.")
    weight_decay: float = option(0.01, help="Weight decay; never applied to biases and norm weights.")
    decoupled_weight_decay: bool = option(False, help="RAdam: decoupled (AdamW-style) weight decay.")
    grad_clip: float = option(1.0, help="Clip the global gradient norm to this value; 0 disables.")

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas}.")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}.")


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning-rate warmup factor and decay (see `pipelines.schedules`)."""

    warmup: str = option(
        "linear",
        help="none | linear | exponential | untuned_linear | untuned_exponential | noam.",
    )
    warmup_steps: int = option(0, help="Warmup length tau (noam: w) in optimizer steps; ignored by untuned warmups.")
    decay: str = option(
        "linear", help="After warmup: constant | linear | cosine | inverse_sqrt | polynomial (use constant with noam)."
    )
    min_lr_ratio: float = option(0.0, help="Floor of the decay as a fraction of the base LR.")
    power: float = option(1.0, help="Exponent of the polynomial decay.")
    d_model: int = option(0, help="Noam: model width; 0 takes the model's hidden size.")


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: objective, budget, precision, evaluation and checkpoint cadence."""

    task: Literal["mlm_nsp", "causal_lm", "image_cls", "classification", "qa"] = option(
        "mlm_nsp", help="Objective; must match the corpus kind."
    )
    run_dir: str = option("runs/default", help="Directory for config.yaml, metrics.jsonl, tb/ and checkpoints/.")
    max_steps: int = option(1000, help="Optimizer steps to train; the run stops at the first budget reached.")
    max_tokens: int = option(0, help="Token budget (0 = none).")
    max_time_minutes: float = option(0.0, help="Wall-time budget in minutes (0 = none); checkpoints before stopping.")
    grad_accum_steps: int = option(1, help="Micro-batches accumulated per optimizer step.")
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", help="fp16 uses dynamic loss scaling.")
    seed: int = option(0, help="Seed for model init, masking and data order.")
    deterministic: bool = option(False, help="Use deterministic kernels (bitwise-reproducible on CPU in fp32).")
    eval_every: int = option(0, help="Evaluate every N steps (0 = only at the end).")
    eval_batches: int = option(20, help="Batches per evaluation (0 = the whole split).")
    checkpoint_every: int = option(0, help="Checkpoint every N steps (0 = only at the end and on signals).")
    keep_last: int = option(2, help="Checkpoints kept; older ones are deleted after a new one is complete.")
    resume: str = option("auto", help="auto (newest complete checkpoint in run_dir), never, or a checkpoint path.")
    log_every: int = option(10, help="Log metrics every N steps.")

    def __post_init__(self) -> None:
        for name in ("max_steps", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}.")


@dataclass(kw_only=True)
class DistributedConfig:
    """How processes cooperate; only `pipelines.distributed` reads the environment."""

    engine: Literal["deepspeed", "ddp"] = option("deepspeed", help="deepspeed (ZeRO) or plain DDP through accelerate.")
    zero_stage: int = option(2, help="DeepSpeed ZeRO stage 0, 1, 2 or 3.")
    offload_optimizer: bool = option(False, help="ZeRO: keep optimizer state in CPU memory.")
    offload_params: bool = option(False, help="ZeRO-3: keep parameters in CPU memory.")
    deepspeed_config: str = option("", help="A DeepSpeed JSON to start from; our fields override its 'auto' values.")
    backend: str = option("auto", help="Process-group backend: auto (nccl on GPU, gloo on CPU), nccl or gloo.")
    timeout_minutes: int = option(30, help="Collective timeout before a hung rank fails the job.")

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"distributed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}.")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError("distributed.offload_params needs zero_stage=3 (DeepSpeed offloads parameters only in ZeRO-3).")


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go and which health policies apply (see `monitoring`)."""

    progress: bool = option(True, help="Live console progress bar on rank 0.")
    tensorboard: bool = option(True, help="Write TensorBoard event files under run_dir/tb.")
    wandb: bool = option(False, help="Log to Weights & Biases through accelerate (offline works).")
    mlflow: bool = option(False, help="Log to MLflow through accelerate.")
    prometheus_port: int = option(0, help="Serve Prometheus /metrics on this port on rank 0 (0 = off; needs prometheus-client).")
    peak_flops: float = option(0.0, help="Peak FLOP/s per device for MFU; 0 = device table or a CPU probe.")
    diagnostics_every: int = option(0, help="Gradient histograms / optimizer statistics every N steps (0 = off).")
    skew_every: int = option(50, help="Gather step times across ranks every N steps to find stragglers.")
    nan_policy: Literal["skip_step", "stop"] = option("skip_step", help="On NaN/Inf loss or gradients.")
    max_consecutive_nan: int = option(5, help="skip_step: stop after this many bad steps in a row.")
    spike_zscore: float = option(6.0, help="Log a loss-spike event above this z-score over the recent window.")
    starvation_share: float = option(0.10, help="Warn when data wait exceeds this share of step time.")

    def __post_init__(self) -> None:
        if not 0 <= self.prometheus_port <= 65535:
            raise ConfigError(f"logging.prometheus_port must be a TCP port (1-65535) or 0 for off, got {self.prometheus_port}.")


@dataclass(kw_only=True)
class RunConfig:
    """Everything a pretraining or fine-tuning run needs; saved as run_dir/config.yaml."""

    data: DataConfig = option(help="Data.", default_factory=DataConfig)
    model: ModelConfig = option(help="Model.", default_factory=ModelConfig)
    optim: OptimConfig = option(help="Optimizer.", default_factory=OptimConfig)
    schedule: ScheduleConfig = option(help="LR schedule.", default_factory=ScheduleConfig)
    train: TrainConfig = option(help="Training loop.", default_factory=TrainConfig)
    distributed: DistributedConfig = option(help="Distribution.", default_factory=DistributedConfig)
    logging: LoggingConfig = option(help="Logging and health.", default_factory=LoggingConfig)


# --------------------------------------------------------------------------------------------
# Loading: YAML with `extends:`, dotted overrides, strict typed conversion
# --------------------------------------------------------------------------------------------


def load_yaml(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML mapping, resolving ``extends:`` (a path or list, relative to the file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist. Check the path (configs live under configs/).")
    resolved = path.resolve()
    if resolved in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, resolved))
        raise ConfigError(f"Config {path} extends itself in a cycle: {chain}. Remove one `extends:`.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"Config file {path} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of sections, found {type(data).__name__}.")
    parents = data.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = _deep_merge(merged, load_yaml(path.parent / parent, (*_seen, resolved)))
    return _deep_merge(merged, data)


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(data: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings; values are parsed as YAML scalars/lists (``lr=3e-4``, ``betas=[0.9,0.98]``)."""
    out = copy.deepcopy(data)  # nested dicts of the input must not change
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"Override {item!r} is not of the form key=value (e.g. optim.lr=3e-4).")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, where: str, source: str) -> Any:
    def bad() -> ConfigError:
        return ConfigError(
            f"{source}: `{where}` expects {_type_name(tp)}, got {value!r} ({type(value).__name__}). "
            f"Set it to a value of that type."
        )

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return from_dict(tp, value, source=source, prefix=f"{where}.")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad()
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where, source)
            except ConfigError:
                continue
        raise bad()
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad()
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_convert(v, item_tp, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {str(k): _convert(v, val_tp, f"{where}.{k}", source) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad()
    raise bad()


def from_dict(cls: type, data: dict[str, Any], *, source: str = "config", prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, refusing unknown keys with a did-you-mean."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f" Did you mean `{prefix}{close[0]}`?" if close else ""
            raise ConfigError(
                f"{source}: unknown key `{prefix}{key}`.{hint} "
                f"Valid keys here: {', '.join(sorted(fields))}."
            )
        kwargs[key] = _convert(value, hints[key], f"{prefix}{key}", source)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(
    path: str | os.PathLike | None, overrides: typing.Iterable[str] = (), cls: type = RunConfig
) -> Any:
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None) plus overrides."""
    data = load_yaml(path) if path is not None else {}
    overrides = list(overrides)
    source = str(path) if path is not None else "defaults"
    if overrides:
        data = apply_overrides(data, overrides)
        source += " + command-line overrides"
    return from_dict(cls, data, source=source)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644 & ~_UMASK)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically); `load_config` reads it back identically."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field, for `--help` listings and docs."""
    rows = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(hint, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("help", "")))
    return rows

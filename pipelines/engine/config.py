"""The run configuration: one keyword-only dataclass per concern (data, model, optim, schedule,
train, distributed, logging), grouped in ``RunConfig``.

A run is a YAML file plus ``key=value`` overrides (``load_run_config``); the resolved config is
written to every run directory (``save_config``) and is enough to rebuild the run. The primitives
(``option``, strict loading, ``ConfigError``) live in ``core.config``; this module imports no torch
so that the CLI can validate a run before any process starts.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from typing import Any, Literal

from core.config import ConfigError, load_config, option
from monitoring.profiler import parse_profile_steps
from monitoring.sink import SINKS
from pipelines.engine.registries import DECAYS, OPTIMIZERS, TASKS, WARMUPS

__all__ = [
    "CorpusWeight",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "TrainConfig",
    "DistributedConfig",
    "LoggingConfig",
    "RunConfig",
    "load_run_config",
]


def check_at_least(section: str, obj: Any, minimum: int, *names: str, why: str = "") -> None:
    """Refuse an integer option below ``minimum`` when the config loads: a ``log_every=0`` would otherwise pass
    every check and divide by zero after the first step, with the run dir already written."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ConfigError(f"{section}.{name} must be >= {minimum}{why}, got {value}. Fix it in the config or the "
                              f"override.")


@dataclass(kw_only=True)
class CorpusWeight:
    """One corpus of a mixture (``data.corpora``)."""

    path: str = option(help="Corpus directory written by `pretrain prepare`.")
    weight: float = option(help="Share of the training samples (weights are normalised to sum to 1).")
    name: str = option("", help="Name in metrics and checkpoints (default: the directory's name).")
    url_prefix: str = option("", help="As data.url_prefix, for this corpus.")

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ConfigError(f"data.corpora: the weight of {self.path!r} must be > 0, got {self.weight}.")
        self.name = self.name or os.path.basename(os.path.normpath(self.path))


@dataclass(kw_only=True)
class DataConfig:
    """Where the training samples come from and how they are batched."""

    corpus: str = option("", help="Corpus directory written by `pretrain prepare` (has manifest.json).")
    corpora: list[CorpusWeight] = option([], help="A weighted mixture instead of `corpus`: [{path: A, weight: 0.3}, "
                                                  "{path: B, weight: 0.7}], same kind and tokenizer; evaluation uses "
                                                  "the first corpus's eval split.")
    micro_batch_size: int = option(32, help="Samples per process per forward pass (with train.global_batch_size: the most).")
    num_workers: int = option(2, help="DataLoader worker processes per rank (0 = load in the main process).")
    shuffle_buffer: int = option(1000, help="Samples held in the per-worker shuffle buffer.")
    prefetch_factor: int = option(2, help="Batches prefetched per DataLoader worker.")
    worker_start_method: Literal["forkserver", "spawn", "fork"] = option(
        "forkserver", help="How DataLoader workers start: forkserver (safe, ~0.1 s each), spawn (~2 s each), or fork, "
                           "which can deadlock a worker of a multi-threaded trainer (see pipelines/loading/workers.py).")
    mlm_probability: float = option(0.15, help="Share of non-special tokens selected for MLM (BERT: 0.15).")
    whole_word_masking: bool = option(False, help="Mask all WordPiece pieces of a selected word together.")
    fixed_shapes: bool = option(False, help="BERT: pad every batch to the corpus's seq_len and its masked rows to "
                                            "ceil(seq_len x mlm_probability) per sequence, so a compiled model sees one "
                                            "shape (one static graph, no recompiles; CUDA graphs possible).")
    image_size: int = option(224, help="Training crop size for image tasks.")
    mixup_alpha: float = option(0.0, help="Mixup Beta(alpha, alpha) for image tasks; 0 disables.")
    crop_scale: list[float] = option([0.08, 1.0], help="Image tasks: the (min, max) share of the stored image's area a "
                                                       "training crop covers (random-resized-crop, torchvision's scale; "
                                                       "[1, 1]: the whole image). 0.08 suits photos, not 8x8 digits.")
    hflip: bool = option(True, help="Image tasks: mirror half the training crops left-right (off for digits and text).")
    on_bad_sample: Literal["skip", "fail"] = option("skip", help="What to do with an undecodable sample.")
    verify_checksums: bool = option(True, help="Check every shard's size and sha256 against the manifest (local: before "
                                                "training; pipe: while streaming).")
    max_bad_share: float = option(0.001, help="Stop the run when more than this share of the samples a loader worker has "
                                              "read are bad (at least 1 per 1000 tolerated); 1 never stops.")
    url_prefix: str = option("", help="Read shards from here instead of the corpus directory: a directory or `pipe:CMD ` "
                                      "(the shard name is appended, or replaces {name}). Only from your own config: "
                                      "a manifest may not name URLs.")
    eval_split: str = option("validation", help="Manifest split used for periodic evaluation.")

    def __post_init__(self) -> None:
        if self.corpus and self.corpora:
            raise ConfigError(f"data.corpus={self.corpus!r} and data.corpora are both set. Use one: data.corpus for a single "
                              f"corpus, data.corpora for a weighted mixture (list the single corpus there too).")
        if not 0.0 <= self.max_bad_share <= 1.0:
            raise ConfigError(f"data.max_bad_share must be in [0, 1], got {self.max_bad_share}.")
        check_at_least("data", self, 1, "micro_batch_size", "prefetch_factor", "image_size")
        check_at_least("data", self, 0, "num_workers", "shuffle_buffer", why=" (0 = in the main process / no shuffle window)")
        if self.mixup_alpha < 0:
            raise ConfigError(f"data.mixup_alpha must be >= 0 (0 = off), got {self.mixup_alpha}.")
        if len(self.crop_scale) != 2 or not 0.0 < self.crop_scale[0] <= self.crop_scale[1] <= 1.0:
            raise ConfigError(f"data.crop_scale must be [min, max] with 0 < min <= max <= 1, got {self.crop_scale}.")


@dataclass(kw_only=True)
class ModelConfig:
    """Which registered model to build (see `models.list_models()`)."""

    name: str = option("bert-tiny", help="Registry name, e.g. bert-tiny, bert-base, gpt-tiny, gpt2-small, vit-tiny.")
    overrides: dict[str, Any] = option({}, help="Fields of the model's own config to change, e.g. {num_layers: 4}.")
    activation_checkpointing: bool = option(False, help="Recompute block activations in backward to save memory.")
    compile: bool = option(False, help="Wrap the model with torch.compile.")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = option(
        "default", help="torch.compile's mode; reduce-overhead replays CUDA graphs (wants data.fixed_shapes for BERT).")
    compile_options: dict[str, Any] = option(
        {}, help="torch.compile's inductor options in place of a compile_mode, e.g. {cpp_wrapper: true} (kernels launched "
                 "from C++: less host time a step), {combo_kernels: true}; torch._inductor.list_options() lists them.")
    compile_regions: Literal["auto", "model", "blocks"] = option(
        "auto", help="What one compiled graph holds: model (the whole model) | blocks (one graph per transformer block, one "
                     "before and one after them: each block's gradients are ready when its backward ends, so DeepSpeed "
                     "ZeRO-1/2 reduces them during the backward) | auto: blocks where DeepSpeed ZeRO-1/2 overlaps its "
                     "reduction (several GPUs, a model of more than one gradient bucket), model elsewhere.")
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = option(
        "auto", help="The attention kernel SDPA tries first in this run, then torch's own order (a call it cannot serve "
                     "falls back); auto: torch's order. benchmarks/attention_backends.py times them on the recipes' shapes.")
    pad_vocab_multiple: int = option(1, help="Text models: round the embedding / LM-head rows up to a multiple of this "
                                             "(64: aligned GPU matmuls). The padded rows are zero, never scored and "
                                             "never exported: a release's vocabulary is the tokenizer's.")
    init_from: str = option("", help="Checkpoint, run dir or release (transformers directory) whose weights start this run; optimizer, schedule and data "
                                     "start fresh (e.g. BERT phase 2 at seq 512 from phase 1). Ignored when resuming.")

    def __post_init__(self) -> None:
        if self.compile_options and self.compile_mode != "default":
            raise ConfigError(f"model.compile_options and model.compile_mode={self.compile_mode} are both set; torch.compile "
                              f"takes one of them. Keep compile_mode=default with compile_options (a mode is a set of "
                              f"options: add its options there), or drop compile_options.")
        if self.pad_vocab_multiple < 1:
            raise ConfigError(f"model.pad_vocab_multiple must be >= 1 (1 = no padding), got {self.pad_vocab_multiple}.")


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer (see `pipelines.engine.optim`)."""

    name: str = option("adamw", registry=OPTIMIZERS,
                       help="Optimizer registry name: adam | adamw | radam | lamb, or one you registered.")
    lr: float = option(1e-3, help="Base (peak) learning rate; ignored by schedule.warmup=noam (Vaswani et al. eq. 3 sets it).")
    betas: list[float] = option([0.9, 0.999], help="Adam-family (beta1, beta2).")
    eps: float = option(1e-8, help="Adam-family epsilon.")
    weight_decay: float = option(0.01, help="Weight decay; never applied to biases and norm weights.")
    decoupled_weight_decay: bool = option(False, help="RAdam: decoupled (AdamW-style) weight decay.")
    grad_clip: float = option(1.0, help="Clip the global gradient norm to this value; 0 disables.")
    kernel: str = option("auto", help="adam / adamw: auto (torch's fused kernel on CUDA, its default elsewhere) | fused | "
                                      "default. Fused skips a bad step on the device: the host reads the step a step later.")

    def __post_init__(self) -> None:
        if self.kernel not in ("auto", "fused", "default"):
            raise ConfigError(f"optim.kernel must be auto, fused or default, got {self.kernel!r}.")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas}.")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}.")


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning-rate warmup factor and decay (see `pipelines.engine.schedules`)."""

    warmup: str = option(
        "linear", registry=WARMUPS,
        help="none | linear | exponential | untuned_linear | untuned_exponential | noam, or one you registered.",
    )
    warmup_steps: int = option(0, help="Warmup length tau (noam: w) in optimizer steps; ignored by untuned warmups.")
    decay: str = option(
        "linear", registry=DECAYS, help="After warmup: constant | linear | cosine | inverse_sqrt | polynomial (use constant with noam)."
    )
    min_lr_ratio: float = option(0.0, help="Floor of the decay as a fraction of the base LR.")
    power: float = option(1.0, help="Exponent of the polynomial decay.")
    d_model: int = option(0, help="Noam: model width; 0 takes the model's hidden size.")

    def __post_init__(self) -> None:
        check_at_least("schedule", self, 0, "warmup_steps", "d_model")


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: objective, budget, precision, evaluation and checkpoint cadence."""

    task: str = option(
        "mlm_nsp", registry=TASKS,
        help="Objective: mlm_nsp | causal_lm | image_cls (fine-tuning: classification | qa), or one you registered; "
             "must match the corpus kind.",
    )
    run_dir: str = option("runs/default", help="Directory for config.yaml, metrics.jsonl, tb/ and checkpoints/.")
    max_steps: int = option(1000, help="Optimizer steps to train; the run stops at the first budget reached.")
    max_tokens: int = option(0, help="Token budget of the run (0 = none).")
    max_time_minutes: float = option(0.0, help="Wall-time budget of the run's training in minutes (0 = none), summed over "
                                               "its invocations as far as its checkpoint holds them; checkpoints before stopping.")
    grad_accum_steps: int = option(1, help="Micro-batches accumulated per optimizer step (derived when global_batch_size is set).")
    global_batch_size: int = option(0, help="Samples per optimizer step over all ranks, held on any number of GPUs: each "
                                            "rank's share in micro-batches of at most data.micro_batch_size, the rest "
                                            "accumulated (0: data.micro_batch_size x grad_accum_steps x ranks).")
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", help="fp16 uses dynamic loss scaling.")
    seed: int = option(0, help="Seed for model init, masking and data order.")
    deterministic: bool = option(False, help="Use deterministic kernels: bitwise-reproducible on CPU in fp32 at a given thread count, compiled or not.")
    eval_every: int = option(0, help="Evaluate every N steps (0 = only at the end).")
    eval_batches: int = option(20, help="Batches per rank per evaluation (0 = the whole split: every sample once, the last partial batch included).")
    checkpoint_every: int = option(0, help="Checkpoint every N steps (0 = only at the end and on signals).")
    keep_last: int = option(2, help="Checkpoints kept; older ones are deleted after a new one is complete.")
    resume: str = option("auto", help="auto (newest checkpoint in run_dir that verifies), never, or a checkpoint path.")
    overwrite: bool = option(False, help="With resume=never in a run dir that has checkpoints: delete them and start "
                                         "over (refused otherwise).")
    log_every: int = option(10, help="Log metrics every N steps.")
    read_late: bool = option(True, help="Between log steps, read a step's loss and gradient norm once the next step is "
                                        "queued, so the host never waits for the device; false: at once, every step.")

    def __post_init__(self) -> None:
        for name in ("max_steps", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}.")
        if self.global_batch_size < 0:
            raise ConfigError(f"train.global_batch_size must be >= 0 (0: micro x accumulation x ranks), got {self.global_batch_size}.")
        check_at_least("train", self, 1, "log_every")
        check_at_least("train", self, 0, "max_tokens", "eval_every", "eval_batches", "checkpoint_every", "keep_last",
                       why=" (0 = off or all, see `pretrain train --help`)")
        check_at_least("train", self, 0, "seed", why=" (numpy seeds the data order)")
        if not self.max_time_minutes >= 0:
            raise ConfigError(f"train.max_time_minutes must be >= 0 (0 = no time budget), got {self.max_time_minutes}.")

    def budget_reached(self, step: int, tokens: int, seconds: float) -> str | None:
        """The budget a run at ``step``, with ``tokens`` trained in ``seconds`` of training, has reached
        (``max_steps``, ``max_tokens`` or ``max_time_minutes``), or None. Every budget is the run's, not one
        invocation's: a rerun of a run that reached one has nothing to do, and raising it trains on.
        ``max_time_minutes`` counts the training time its checkpoint holds (from the end of start-up to the
        save, over every invocation); time after the last checkpoint is not counted, as its steps are redone."""
        if step >= self.max_steps:
            return "max_steps"
        if 0 < self.max_tokens <= tokens:
            return "max_tokens"
        if 0 < self.max_time_minutes <= seconds / 60:
            return "max_time_minutes"
        return None


@dataclass(kw_only=True)
class DistributedConfig:
    """How processes cooperate; only `pipelines.engine.distributed` reads the environment."""

    engine: Literal["deepspeed", "ddp"] = option("deepspeed", help="deepspeed (ZeRO) or plain DDP through accelerate.")
    zero_stage: int = option(2, help="DeepSpeed ZeRO stage 0, 1, 2 or 3.")
    offload_optimizer: bool = option(False, help="ZeRO: keep optimizer state in CPU memory.")
    offload_params: bool = option(False, help="ZeRO-3: keep parameters in CPU memory.")
    deepspeed_config: str = option("", help="A DeepSpeed JSON to start from; our fields override its 'auto' values.")
    backend: str = option("auto", help="Process-group backend: auto (nccl on GPU, gloo on CPU), nccl or gloo.")
    timeout_minutes: int = option(30, help="Collective timeout before a hung rank fails the job.")
    world_free_checkpoints: bool = option(True, help="ZeRO 1-3: each checkpoint also holds the weights and optimizer "
                                          "state by parameter name (+12 B/param for Adam), so the run can resume on "
                                          "another number of GPUs or ZeRO stage.")
    one_rank_fast_path: bool = option(True, help="One process: skip the per-step work that is an identity on a world "
                                      "of one (DDP's gradient all-reduce; DeepSpeed's collectives, bucket copy and "
                                      "per-parameter norm loops; same weights bitwise, pipelines/engine/one_rank.py). "
                                      "false runs the stock DDP wrapper and stock DeepSpeed.")
    zero_step_on_device: bool = option(True, help="ZeRO-1/2, any number of ranks: the optimizer step takes the gradient "
                                       "norm in one multi-tensor call and clips and (with optim.kernel=fused) skips a "
                                       "non-finite step on the device, reading nothing back; same weights bitwise, "
                                       "pipelines/engine/zero_step.py. false: DeepSpeed's own step (on one rank, "
                                       "one_rank_fast_path=false also runs it).")

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"distributed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}.")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError("distributed.offload_params needs zero_stage=3 (DeepSpeed offloads parameters only in ZeRO-3).")
        check_at_least("distributed", self, 1, "timeout_minutes")


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go and which health policies apply (see `monitoring`)."""

    progress: bool = option(True, help="Live console progress bar on rank 0.")
    tensorboard: bool = option(True, help="Write TensorBoard event files under run_dir/tb.")
    wandb: bool = option(False, help="Log to Weights & Biases through accelerate (offline works).")
    mlflow: bool = option(False, help="Log to MLflow through accelerate.")
    prometheus_port: int = option(0, help="Serve Prometheus /metrics on this port on rank 0 (0 = off; needs prometheus-client).")
    prometheus_host: str = option("127.0.0.1", help="Address the Prometheus endpoint binds: 127.0.0.1 = this host only; "
                                                    "0.0.0.0 = every interface (anyone who can reach the node).")
    sinks: list[str] = option([], registry=SINKS, help="Further registered metric sinks by name (monitoring.sink."
                                                       "register_sink), besides console, metrics.jsonl and the switches above.")
    sample_keys: str = option("", help="Per-step sample-key log: a directory (relative to train.run_dir, e.g. "
                                       "sample_keys) where each rank appends {step, loss, keys, pid} to rank-N.jsonl: "
                                       "which samples every optimizer step trained on, for data-order audits and "
                                       "resume checks; costs one host read per step. Empty = off.")
    peak_flops: float = option(0.0, help="Peak FLOP/s per device for MFU; 0 = device table or a CPU probe.")
    diagnostics_every: int = option(0, help="Gradient histograms / optimizer statistics every N steps (0 = off).")
    profile_steps: str = option("", help="torch.profiler over these optimizer steps, e.g. 21-25 (after compilation and "
                                         "warm-up): run_dir/profile/rank-00000.txt (operators by self device or CPU time, "
                                         "call counts: host syncs show as aten::_local_scalar_dense) and a Chrome "
                                         "trace. Empty = off.")
    skew_every: int = option(50, help="Gather step times across ranks every N steps to find stragglers.")
    nan_policy: Literal["skip_step", "stop"] = option("skip_step", help="On NaN/Inf loss or gradients.")
    max_consecutive_nan: int = option(5, help="skip_step: stop after this many bad steps in a row.")
    spike_zscore: float = option(6.0, help="Log a loss-spike event above this z-score over the recent window.")
    starvation_share: float = option(0.10, help="Warn when data wait exceeds this share of step time.")

    def __post_init__(self) -> None:
        parse_profile_steps(self.profile_steps)  # a malformed window is refused when the config loads
        if not 0 <= self.prometheus_port <= 65535:
            raise ConfigError(f"logging.prometheus_port must be a TCP port (1-65535) or 0 for off, got {self.prometheus_port}.")
        check_at_least("logging", self, 0, "diagnostics_every", "skew_every", why=" (0 = off)")
        check_at_least("logging", self, 0, "max_consecutive_nan")


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




def load_run_config(path: str | os.PathLike | None, overrides: typing.Iterable[str] = ()) -> RunConfig:
    """A ``RunConfig`` from a YAML file (or the defaults when ``path`` is None) plus overrides."""
    return load_config(path, overrides, cls=RunConfig)

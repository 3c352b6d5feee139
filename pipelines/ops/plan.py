"""``pretrain plan``: memory, checkpoint, failure, throughput and loader arithmetic for a run config on N GPUs.

Torch-free and instant (``tests/pipelines/test_plan.py`` proves it): it reads the config, the model's
shape (``model_shapes``) and the constants of ``plan_constants`` (each with its source), and prints

- memory per GPU under ZeRO 0-3 (+ optimizer / parameter offload), with and without activation
  checkpointing: weights, gradients, optimizer state, DeepSpeed's buffers, activations, and whether
  it fits (Rajbhandari et al. 2020, "ZeRO", Sec. 3-5, with DeepSpeed's byte accounting: 2 B bf16
  weights, 2 B bf16 grads, 4 B fp32 grads + 4 B fp32 master + 8 B Adam moments, partitioned by stage);
- checkpoint bytes (DeepSpeed's files + our world-size-free copy) and the save time at a file system
  bandwidth, including rank 0's sha256 of every file;
- the checkpoint interval that minimises lost work for the job's failure rate: Young 1974 ("A first
  order approximation to the optimum checkpoint interval", CACM 17(9)) tau = sqrt(2 delta M) and Daly
  2006 ("A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3),
  eq. 37), with Daly's expected wall time (eq. 13) for the days;
- tokens/s from our measured MFU, the days to the token budget, and loader workers per GPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from core.config import ConfigError
from pipelines.engine.check import (
    ONE_RANK_ZERO3,
    batch_split,
    check,
    is_pretraining_task,
    split_batch,
    zero_overlap,
)
from pipelines.engine.registries import OPTIMIZERS
from pipelines.ops import plan_constants as K
from pipelines.ops.model_shapes import (
    MODEL_SHAPES,
    ModelShape,
    activation_bytes,
    flops_per_sample,
    largest_layer_params,
    loss_backward_bytes,
    model_shape,
    param_count,
    tokens_per_sample,
)

__all__ = ["PlanOptions", "MemoryRow", "Plan", "make_plan", "memory_rows", "checkpoint_bytes", "young_interval",
           "daly_interval", "daly_wall_time", "duration_text"]



@dataclass(kw_only=True)
class PlanOptions:
    """The job: GPUs, their kind, the failure rate and the file system."""

    gpus: int
    gpus_per_node: int = 8
    gpu: str = "h100"
    node_mtbf_hours: float = 0.0  # 0: FAILURES["node_mtbf_hours"]
    restart_minutes: float = 0.0  # 0: FAILURES["restart_minutes"]
    fs_gbps: float = 0.0  # aggregate write (and read) bandwidth of the checkpoint file system, GB/s; 0: required
    global_batch: int = 0  # samples per optimizer step; 0: micro x accum x gpus of the config
    seq_len: int = 0  # 0: the model's context length

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"--gpus ({self.gpus}) and --gpus-per-node ({self.gpus_per_node}) must be >= 1.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node "
                              f"{self.gpus_per_node}. Use a multiple of {self.gpus_per_node}.")
        if self.gpu not in K.GPU_KINDS:
            raise ConfigError(f"--gpu {self.gpu}: no datasheet entry. Use one of: {', '.join(K.GPU_KINDS)}.")
        if not (math.isfinite(self.fs_gbps) and self.fs_gbps > 0):  # nan passes `<= 0`
            raise ConfigError(f"--fs-gbps {self.fs_gbps}: the checkpoint file system's aggregate write bandwidth in GB/s "
                              f"must be a number > 0: measure yours (e.g. fio, or benchmarks/checkpoint_hash.py --dir /shared/runs).")
        for flag, value in (("--node-mtbf-hours", self.node_mtbf_hours), ("--restart-minutes", self.restart_minutes),
                            ("--global-batch", self.global_batch), ("--seq-len", self.seq_len)):
            if not (math.isfinite(value) and value >= 0):  # a plan from a negative or nan figure is nonsense, not an error
                raise ConfigError(f"{flag} {value}: must be a number >= 0 (0 or left out: the default). Fix the flag.")

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.gpus / self.gpus_per_node))


@dataclass
class MemoryRow:
    """Bytes per GPU (and CPU bytes per node under offload) for one ZeRO stage / offload / checkpointing choice."""

    stage: int
    offload: str  # "" | "optimizer" | "optimizer+params"
    checkpointing: bool
    weights: float
    grads: float
    optimizer: float
    buffers: float
    activations: float
    cpu_per_node: float
    limit: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.buffers + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.limit


@dataclass
class Plan:
    """Everything ``render_plan`` prints; the numbers are plain floats (bytes, seconds, tokens)."""

    config: str
    model: str
    shape: ModelShape
    options: PlanOptions
    params: int
    seq_len: int
    seq_source: str
    micro_batch: int
    grad_accum: int
    global_batch: int
    tokens_per_step: int
    token_budget: float
    memory: list[MemoryRow]
    run_row: MemoryRow
    checkpoint: dict[str, float]
    failure: dict[str, float]
    throughput: dict[str, float]
    loader: dict[str, float]
    notes: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def _precision_bytes(precision: str) -> tuple[int, int]:
    """(weight / activation bytes, fp32 master + fp32 grad partition?) for the engine's precision."""
    return int(K.BYTES[precision].value), 1 if precision in ("bf16", "fp16") else 0


def memory_rows(P: int, largest_layer: int, *, engine: str, precision: str, moments: int, gpus: int, gpus_per_node: int,
                activations: dict[bool, float], head_transient: float, limit: float, overlap: bool = False) -> list[MemoryRow]:
    """ZeRO 0-3 (+ offload) x activation checkpointing.

    Mixed precision (DeepSpeed bf16/fp16): bf16 weights 2P and grads 2P, an fp32 master 4P, fp32 grads
    4P and the moments 4 m P, partitioned by stage (1: optimizer state; 2: + gradients; 3: + weights).
    fp32: weights and grads 4P, the master only under ZeRO >= 1. ZeRO-0 is plain data parallelism (nothing
    partitioned; DeepSpeed's bf16 optimizer at stage 0 partitions like ZeRO-1, so its row is an upper bound).
    Buffers: ZeRO-1/2 reduce buckets (two with ``overlap``: distributed.overlap_comm), ZeRO-3 two gathered
    copies of the largest layer (DeepSpeed's estimate) + the prefetch bucket.
    """
    w, mixed = _precision_bytes(precision)
    N = gpus
    rows = []
    stages = (0,) if engine == "ddp" else (0, 1, 2, 3)
    for stage in stages:
        offloads = [""] if stage == 0 else ["", "optimizer"] + (["optimizer+params"] if stage == 3 else [])
        for offload in offloads:
            weights = w * P / (N if stage == 3 else 1)
            grads = w * P / (N if stage >= 2 else 1)
            # fp32 master (DeepSpeed keeps one under ZeRO >= 1 even in fp32, as its checkpoints show) + fp32
            # gradients (mixed precision only) + the moments
            master = 4 if engine == "deepspeed" and (stage >= 1 or mixed) else 0
            optimizer = (master + 4 * mixed + 4 * moments) * P / (N if stage >= 1 else 1)
            rb = min(K.DEEPSPEED["reduce_bucket_size"].value, P)
            if stage in (1, 2):
                buffers = rb * (2 if overlap else 1) * (4 if stage == 1 else w)
            elif stage == 3:
                buffers = 2 * w * largest_layer + w * K.DEEPSPEED["zero3_prefetch_bucket_size"].value + rb * w
            else:
                buffers = 0.0
            cpu = 0.0
            if offload:  # the gradient partition goes to the CPU with the optimizer (DeepSpeed's estimate: GPU 2P)
                grads = 0.0
                cpu += optimizer * gpus_per_node * K.DEEPSPEED["offload_cpu_buffer_factor"].value
                optimizer = 0.0
            if offload == "optimizer+params":
                cpu += weights * gpus_per_node * K.DEEPSPEED["offload_cpu_buffer_factor"].value
                weights = 0.0
            for ckpt in (False, True):
                rows.append(MemoryRow(stage, offload, ckpt, weights, grads, optimizer, buffers,
                                      activations[ckpt] + head_transient, cpu, limit))
    return rows


def checkpoint_bytes(P: int, *, engine: str, precision: str, stage: int, moments: int, world_free: bool) -> dict[str, float]:
    """Bytes of one checkpoint (all ranks): DeepSpeed's module and optimizer files and the world-size-free copy.

    DeepSpeed writes the module's weights once (rank 0; none under ZeRO-3, whose partitions are in the
    optimizer files) and, for ZeRO >= 1 or bf16/fp16, the fp32 master + moments of every partition;
    ``reshard.save_world_free`` adds 4 B x (1 + moments) per parameter under ZeRO >= 1.
    """
    w, mixed = _precision_bytes(precision)
    module = 0.0 if stage == 3 else w * P
    master = 4 * P if (engine == "deepspeed" and (stage >= 1 or mixed)) else 0
    optim = master + 4 * moments * P
    free = (1 + moments) * K.CHECKPOINT["world_free_bytes_per_param_per_state"].value * P if (
        world_free and engine == "deepspeed" and stage >= 1) else 0.0
    return {"module": module, "optimizer": float(optim), "world_free": float(free), "total": module + optim + free}


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young (1974): the compute time between checkpoints that minimises lost work, sqrt(2 delta M)."""
    return math.sqrt(2 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 37: sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta, or M when delta >= 2M."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


def daly_wall_time(solve_s: float, tau_s: float, delta_s: float, mtbf_s: float, restart_s: float) -> float:
    """Daly (2006), eq. 13: expected wall time M e^{R/M} (e^{(tau + delta)/M} - 1) T_s / tau of a job of T_s compute."""
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((tau_s + delta_s) / mtbf_s) * solve_s / tau_s


def _batch(cfg: Any, opts: PlanOptions) -> tuple[Any, tuple[int, int, int]]:
    """The config as a run on ``--gpus`` has it -- ``--global-batch``, if given, as its ``train.global_batch_size`` --
    and its (micro batch, grad accumulation, global batch) there, split as the run splits it."""
    if opts.global_batch:
        split_batch(int(cfg.data.micro_batch_size), 1, opts.global_batch, opts.gpus, key="--global-batch")  # the flag's error
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=opts.global_batch))
    return cfg, batch_split(cfg, opts.gpus)


def duration_text(s: float) -> str:
    """Seconds as a plan prints them: ms, s, min, h or days."""
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.0f} s"
    if s < 2 * 3600:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _train_samples(cfg: Any) -> int:
    """The training samples of ``data.corpus`` (its manifest), or 0: none set, or a blend of several corpora."""
    if not cfg.data.corpus:
        return 0
    from core.corpus import read_manifest

    return int(((read_manifest(cfg.data.corpus).get("splits") or {}).get("train") or {}).get("samples") or 0)


def _corpus_facts(cfg: Any, family: str) -> tuple[dict[str, Any], str]:
    """What the trainer takes from the corpus (``objectives.*.model_kwargs``): vocab_size and seq_len for text,
    num_labels for images; the image size is ``data.image_size``. No corpus set: the model's own defaults."""

    facts: dict[str, Any] = {"image_size": int(cfg.data.image_size)} if family == "vit" else {}
    corpus = cfg.data.corpus or (cfg.data.corpora[0].path if cfg.data.corpora else "")
    if not corpus:
        return facts, "the model's context: no data.corpus; pass --seq-len or data.corpus=DIR"
    from core.corpus import read_manifest  # only with a corpus: it brings numpy, which the bare plan does not need

    raw = read_manifest(corpus)  # a clear error naming the file when it is not a corpus
    if family == "vit":
        labels = raw.get("class_map") or {}
        facts["raw_images"] = (raw.get("images") or {}).get("format") == "raw"  # else encoded, decoded by the loader
        return ({**facts, "num_labels": max(labels.values()) + 1} if labels else facts), f"{corpus}/manifest.json"
    vocab = int((raw.get("tokenizer") or {}).get("vocab_size") or 0)
    return {"vocab_size": vocab or MODEL_SHAPES[cfg.model.name].vocab_size,
            "seq_len": int(raw.get("seq_len") or 0)}, f"{corpus}/manifest.json"


def _mfu(cfg: Any, family: str) -> tuple[K.Constant, str]:
    """The measured MFU for the family (GPT's compiled or eager, as the config runs), and which run it is."""
    key = "gpt-eager" if family == "gpt" and not cfg.model.compile else family
    return K.MEASURED_MFU[key], K.MFU_MODE[key]


def make_plan(cfg: Any, opts: PlanOptions, *, config_name: str = "") -> Plan:
    """The plan of a pretraining ``RunConfig`` on ``opts.gpus`` GPUs (raises ConfigError on what cannot run)."""
    if not is_pretraining_task(cfg.train.task):
        raise ConfigError(f"{config_name or 'the config'}: train.task={cfg.train.task} is fine-tuning; `pretrain plan` "
                          f"plans pretraining runs (configs/train/). Pass a pretraining config.")
    cfg, (micro, accum, global_batch) = _batch(cfg, opts)
    check(cfg, world_size=opts.gpus)
    if cfg.model.name not in MODEL_SHAPES:
        raise ConfigError(f"model.name={cfg.model.name} has no torch-free shape in pipelines/ops/model_shapes.py; add it "
                          f"there (tests/pipelines/test_plan.py checks it against the registry).")
    facts, seq_note = _corpus_facts(cfg, MODEL_SHAPES[cfg.model.name].family)
    shape = model_shape(cfg.model.name, {**cfg.model.overrides, **facts})
    family, d = shape.family, cfg.distributed
    gpu = K.GPU_KINDS[opts.gpu]
    seq = opts.seq_len or int(facts.get("seq_len") or 0) or shape.max_position_embeddings
    seq_note = "--seq-len" if opts.seq_len else seq_note
    P, moments = param_count(shape), OPTIMIZERS.lookup(cfg.optim.name).state_tensors
    w, _ = _precision_bytes(cfg.train.precision)
    mlm = float(cfg.data.mlm_probability)  # BERT: our MLM head runs at the masked share of positions
    compiled = bool(cfg.model.compile)  # the LM head's loss keeps and adds less compiled (pipelines/ops/model_shapes.py)
    autocast = d.engine == "ddp" and cfg.train.precision != "fp32"  # fp32 weights, a half-precision forward
    acts = {ck: sum(activation_bytes(shape, micro_batch=micro, seq_len=seq, act_bytes=w, checkpointing=ck,
                                     mlm_fraction=mlm, compiled=compiled, autocast=autocast)[k]
                    for k in ("total", "recompute")) for ck in (False, True)}
    head_transient = loss_backward_bytes(shape, micro_batch=micro, seq_len=seq, act_bytes=w, compiled=compiled,
                                         mlm_fraction=mlm)
    limit = (1 - K.MEMORY_RESERVE.value) * gpu.memory_bytes.value
    # ZeRO-1/2's overlap_comm: on only where a bucket's reduction can overlap the backward (as the engine sets it on GPUs);
    # model.compile_regions auto compiles block by block there, which overlaps as eager does
    overlap, per_block = zero_overlap(cfg, opts.gpus, P, K.DEEPSPEED["reduce_bucket_size"].value)
    overlap = overlap and d.engine == "deepspeed" and d.zero_stage in (1, 2)
    rows = memory_rows(P, largest_layer_params(shape), engine=d.engine, precision=cfg.train.precision, moments=moments,
                       gpus=opts.gpus, gpus_per_node=min(opts.gpus, opts.gpus_per_node), activations=acts,
                       head_transient=head_transient, limit=limit, overlap=overlap)
    offload = "optimizer+params" if d.offload_params else "optimizer" if d.offload_optimizer else ""
    stage = d.zero_stage if d.engine == "deepspeed" else 0
    run_row = next(r for r in rows if r.stage == stage and r.offload == offload and
                   r.checkpointing == cfg.model.activation_checkpointing)

    # throughput: measured MFU x this kind's peak; communication at datasheet bandwidth
    mfu, mode = _mfu(cfg, family)
    tokens_sample = tokens_per_sample(shape, seq)
    flops_sample = flops_per_sample(shape, seq, mlm_fraction=mlm)
    peak = gpu.bf16_flops.value
    # full activation recomputation runs every block's forward twice: 8 N instead of 6 N per token (Korthikanti et
    # al. 2022, Sec. 5), so the measured MFU buys 3/4 of the model FLOPs
    recompute = 4 / 3 if cfg.model.activation_checkpointing else 1.0
    compute_s = global_batch / opts.gpus * flops_sample * recompute / (mfu.value * peak)
    bw = gpu.nvlink_bytes_s.value if opts.nodes == 1 else gpu.network_bytes_s.value
    ring = (opts.gpus - 1) / opts.gpus
    volume = {0: 2 * w * P, 1: 2 * w * P, 2: (accum + 1) * w * P, 3: 3 * accum * w * P}[stage] * ring
    comm_s = volume / bw
    # what of it the step waits for (benchmarks/comm_overlap.py): a reduction hides only under the backward that is
    # still computing when it starts (~2/3 of a micro-batch's compute). DDP reduces its buckets during the last
    # micro-batch's backward (no_sync before it; compiled too: dynamo cuts the graph at DDP's buckets); eager ZeRO-2
    # with ``overlap`` reduce-scatters during every micro-batch's backward but gathers the updated weights after the
    # step; ZeRO-3 prefetches through forward and backward. DeepSpeed ZeRO-0/1, and ZeRO-2 compiled as one graph (its
    # gradients all arrive once the compiled backward ends) or in one bucket, reduce after the backward: all of it adds.
    backward_s = 2 / 3 * compute_s
    gather_s = w * P * ring / bw if d.engine == "deepspeed" and stage in (1, 2) else 0.0
    if d.engine == "ddp":
        exposed_s = max(0.0, comm_s - backward_s / accum)
    elif stage == 3:
        exposed_s = max(0.0, comm_s - compute_s)
    elif overlap and stage == 2:
        exposed_s = max(0.0, comm_s - gather_s - backward_s) + gather_s
    else:
        exposed_s = comm_s
    host_s = accum * shape.num_layers * K.HOST_S_PER_LAYER.value  # the launches of each micro-batch's layers
    step_s = max(compute_s + exposed_s, host_s)
    samples_s = global_batch / step_s
    tokens_step = global_batch * (seq if family != "vit" else 1)
    budget = float(cfg.train.max_tokens) if cfg.train.max_tokens else float(cfg.train.max_steps * tokens_step)
    steps = budget / tokens_step
    solve_s = steps * step_s
    train_samples = _train_samples(cfg)

    # checkpoints and failures
    ck = checkpoint_bytes(P, engine=d.engine, precision=cfg.train.precision, stage=stage, moments=moments,
                          world_free=d.world_free_checkpoints)
    fs = opts.fs_gbps * 1e9
    sha = K.CHECKPOINT["sha256_bytes_s"].value
    write_s, hash_s = ck["total"] / fs, ck["total"] / sha
    delta = write_s + hash_s
    load_s = ck["total"] / fs + hash_s  # read back + verify_checkpoint's sha256
    node_mtbf = opts.node_mtbf_hours or K.FAILURES["node_mtbf_hours"].value
    M = node_mtbf * 3600 / opts.nodes
    R = (opts.restart_minutes or K.FAILURES["restart_minutes"].value) * 60 + load_s
    tau_y, tau_d = young_interval(delta, M), daly_interval(delta, M)
    tau_d = min(tau_d, solve_s)  # a run shorter than the optimum interval needs no periodic save
    config_tau = cfg.train.checkpoint_every * step_s if cfg.train.checkpoint_every else solve_s
    wall_best = daly_wall_time(solve_s, tau_d, delta, M, R)
    wall_config = daly_wall_time(solve_s, min(config_tau, solve_s), delta, M, R)

    # loader
    if family == "vit":  # the recipe's raw pixels unless the corpus stores encoded images
        cpu_per_sample = K.LOADER_CPU_S_PER_SAMPLE["images-raw" if facts.get("raw_images", True) else "images-encoded"]
        cpu_s = cpu_per_sample.value
    else:
        cpu_per_sample = K.LOADER_CPU_S_PER_SAMPLE["text"]
        cpu_s = cpu_per_sample.value * seq
    cores = samples_s / opts.gpus * cpu_s
    workers = max(1, math.ceil(K.LOADER_HEADROOM.value * cores))

    notes = []
    if stage == 3 and opts.gpus == 1 and not d.offload_params:
        notes.append(ONE_RANK_ZERO3)
    if d.engine == "deepspeed" and stage < 3 and opts.gpus > 1 and exposed_s > 0.1 * compute_s and comm_s <= compute_s:
        what = ("the weights gathered after the update" if overlap and stage == 2
                else f"its gradients reduced after the {'compiled ' if compiled and not per_block else ''}backward")
        notes.append(f"ZeRO-{stage}: {duration_text(exposed_s)} of communication per step are not hidden by the backward and add "
                     f"to {duration_text(compute_s)} of compute ({what}). "
                     f"distributed.engine=ddp overlaps its reduction with the backward, where the model state fits "
                     f"without partitioning (the ZeRO-0 row).")
    if host_s > compute_s + exposed_s:
        notes.append(f"host-bound: {micro} samples a micro-batch leave the GPU {duration_text(compute_s + exposed_s)} of work "
                     f"a step, less than the {duration_text(host_s)} the host needs to launch {shape.num_layers} layers' "
                     f"kernels {accum} time(s); the figures above use the host's time. A larger data.micro_batch_size (or "
                     f"model.compile_mode=reduce-overhead: CUDA graphs) buys throughput here, not more GPUs.")
    if comm_s > compute_s:
        notes.append(f"communication-bound: ZeRO-{stage} moves {volume / 1e9:.1f} GB per GPU per step at "
                     f"{bw / 1e9:.0f} GB/s = {duration_text(comm_s)} > {duration_text(compute_s)} of compute; raise the micro batch, or use "
                     f"ZeRO-1 with grad accumulation (it reduces once per optimizer step, ZeRO-2/3 every micro "
                     f"step), or fewer GPUs.")
    if not run_row.fits:
        # least change first: no offload, then no recomputation, then the nearest stage
        fitting = sorted((r for r in rows if r.fits), key=lambda r: (bool(r.offload), r.checkpointing, abs(r.stage - stage)))
        hint = (f" The first that fits: ZeRO-{fitting[0].stage}{' + offload ' + fitting[0].offload if fitting[0].offload else ''}"
                f"{' with activation checkpointing' if fitting[0].checkpointing else ''}." if fitting else
                " Nothing fits: lower data.micro_batch_size.")
        notes.append(f"the config as written (ZeRO-{stage}) needs {run_row.total / 2**30:.1f} GiB per GPU, more than "
                     f"{limit / 2**30:.1f} GiB usable on an {gpu.label}.{hint}")
    if cfg.data.num_workers < workers:
        notes.append(f"data.num_workers={cfg.data.num_workers} < {workers} loader workers per GPU needed; set "
                     f"data.num_workers={workers}.")
    if config_tau < tau_d / 4:
        notes.append(f"train.checkpoint_every={cfg.train.checkpoint_every} steps saves every {duration_text(config_tau)}: "
                     f"{delta / config_tau:.1%} of the time goes to saves ({duration_text(delta)} each); Daly's optimum is "
                     f"{max(1, round(tau_d / step_s)):,} steps (keep it shorter only to keep more snapshots).")
    if config_tau > 2 * tau_d:
        notes.append(f"train.checkpoint_every={cfg.train.checkpoint_every} steps is {config_tau / 3600:.1f} h of "
                     f"compute, over twice Daly's optimum; set train.checkpoint_every={max(1, round(tau_d / step_s))}.")
    sources = [f"MFU {mfu.value:.1%} ({mode}): {mfu.source}", f"host: {K.HOST_S_PER_LAYER.source}",
               f"loader: {cpu_per_sample.source}",
               f"GPU: {gpu.bf16_flops.source}; {gpu.memory_bytes.source}",
               f"bandwidth: {(gpu.nvlink_bytes_s if opts.nodes == 1 else gpu.network_bytes_s).source}",
               f"sha256: {K.CHECKPOINT['sha256_bytes_s'].source}",
               f"node MTBF: {'--node-mtbf-hours' if opts.node_mtbf_hours else K.FAILURES['node_mtbf_hours'].source}",
               f"restart: {'--restart-minutes' if opts.restart_minutes else K.FAILURES['restart_minutes'].source}",
               f"fits: {K.MEMORY_RESERVE.source}"]
    return Plan(
        config=config_name, model=cfg.model.name + (" + model.overrides" if cfg.model.overrides else ""), shape=shape, options=opts, params=P, seq_len=seq, seq_source=seq_note,
        micro_batch=micro,
        grad_accum=accum, global_batch=global_batch, tokens_per_step=tokens_step, token_budget=budget, memory=rows,
        run_row=run_row, checkpoint={**ck, "write_s": write_s, "hash_s": hash_s, "save_s": delta, "load_s": load_s,
                                     "keep_last": cfg.train.keep_last},
        failure={"node_mtbf_h": node_mtbf, "job_mtbf_s": M, "restart_s": R, "young_s": tau_y, "daly_s": tau_d,
                 "daly_steps": tau_d / step_s, "config_s": config_tau, "wall_best_s": wall_best,
                 "wall_config_s": wall_config},
        throughput={"mfu": mfu.value, "flops_per_sample": flops_sample, "tokens_per_sample": tokens_sample,
                    "compute_s": compute_s, "comm_s": comm_s, "exposed_comm_s": exposed_s, "comm_bytes": volume,
                    "host_s": host_s,
                    "step_s": step_s,
                    "samples_s": samples_s, "tokens_s": samples_s * (seq if family != "vit" else 1),
                    "steps": steps, "solve_s": solve_s,
                    "train_samples": train_samples, "epochs": steps * global_batch / train_samples if train_samples else 0.0},
        loader={"cpu_s_per_sample": cpu_s, "cores_per_gpu": cores, "workers": workers, "config_workers": cfg.data.num_workers},
        notes=notes, sources=sources,
    )

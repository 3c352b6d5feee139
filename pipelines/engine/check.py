"""``check(cfg)``: validate a run config completely before anything launches — without torch.

The CLI calls it before spawning ranks (``pretrain train --nproc N``), a sweep calls it for every
grid point before the first run, and every rank calls it again (``distributed.validate``) before
the process group starts. It covers what a typed load cannot: registry names (model sizes and
the tasks their families pretrain under, from the torch-free family specs of ``core.families``;
schedule warmups/decays), a schedule dry-run with the run's real values, the batch / world
arithmetic (``batch_split``: ``train.global_batch_size`` over the ranks) and the distributed options
that exclude each other. Device-specific checks (fp16 on a CPU, nccl without GPUs) stay in
``distributed.validate``, which knows the device.

``check_inputs(cfg)`` is the other half of a pre-launch check: the files the job will read (the
corpus manifest and its size against the world, fine-tuning's data files) exist. ``pretrain train``
/ ``finetune`` run it before any process starts, whatever ``--nproc``; ``pretrain submit`` too (a
``--dry-run`` turns what it finds into warnings, so a script for a cluster path still renders).

This module imports no torch (``tests/pipelines/test_check.py`` proves it): checking a 64-point
sweep or a launch costs milliseconds.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any

from core.config import ConfigError, check_registry_names
from core.families import UnknownModel, families_for_task, family_of_model, model_catalog, model_names
from pipelines.engine.schedules import build_schedule

__all__ = ["ACCELERATE_PRECISION", "apply_batch_split", "batch_split", "bucket_overlap", "check", "check_accelerate_file", "check_inputs", "check_run_dir",
           "is_pretraining_task", "model_catalog", "model_width", "one_graph_per_block", "run_schedule", "split_batch",
           "zero_overlap"]


def is_pretraining_task(task: str) -> bool:
    """A model family pretrains under ``task`` (else it is a fine-tuning task: the checkpoint has the architecture)."""
    return bool(families_for_task(task))


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean `{close[0]}`?" if close else ""


def model_width(cfg: Any) -> int:
    """The model's hidden size from ``model.overrides`` or the catalogue (0 when the config has no model)."""
    model = getattr(cfg, "model", None)
    if model is None:
        return 0
    width = model.overrides.get("hidden_size")
    if isinstance(width, int) and width > 0:
        return width
    return model_catalog().get(model.name, ("", 0))[1]


def run_schedule(cfg: Any, *, d_model: int = 0):
    """The LR multiplier of a run (``build_schedule`` with the run's LR, steps, beta2 and model width).

    The trainer, ``check`` and the study report all draw a run's schedule through this one call.
    """
    return build_schedule(cfg.schedule, base_lr=cfg.optim.lr, total_steps=cfg.train.max_steps,
                          d_model=d_model or model_width(cfg), beta2=cfg.optim.betas[1])


def _check_model(cfg: Any) -> None:
    """The model size is registered, and its family pretrains under ``train.task`` (the family specs say)."""
    model = getattr(cfg, "model", None)
    needs = families_for_task(cfg.train.task)
    if model is None or not needs:  # fine-tuning: the checkpoint has the architecture
        return
    try:
        family = family_of_model(model.name).name
    except UnknownModel:
        raise ConfigError(
            f"model.name: unknown model `{model.name}`.{_did_you_mean(model.name, model_names())} "
            f"Choose one of: {', '.join(model_names())}."
        ) from None
    if family not in {spec.name for spec in needs}:
        fits = ", ".join(sorted(size for spec in needs for size in spec.sizes))
        raise ConfigError(
            f"train.task={cfg.train.task} needs a {' or '.join(spec.name for spec in needs)} model but "
            f"model.name={model.name} is a {family} model. Set model.name to one of: {fits}."
        )


def _check_schedule(cfg: Any) -> None:
    """Build the run's schedule and evaluate it at the first, warmup-end and last update."""
    fn = run_schedule(cfg, d_model=model_width(cfg) or 1)  # fine-tuning: width only scales noam, not its validity
    total = cfg.train.max_steps
    for step in sorted({0, max(0, min(total, getattr(fn, "warmup_end", 0)) - 1), total - 1}):
        value = fn(step)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"schedule: the learning-rate multiplier at step {step} is {value} (warmup={cfg.schedule.warmup}, "
                f"decay={cfg.schedule.decay}, warmup_steps={cfg.schedule.warmup_steps}). Fix the schedule values."
            )


#: ZeRO-3 in a world of one: the same bytes as ZeRO-2 and the host cost of its per-module hooks (docs/benchmarks.md,
#: engine_overhead); `distributed.validate` logs it, `pretrain plan` notes it.
ONE_RANK_ZERO3 = ("distributed.zero_stage=3 on one process partitions nothing: it holds what ZeRO-2 holds, runs eager "
                  "(model.compile needs zero_stage <= 2) and pays its per-module parameter hooks on every step (3.1x "
                  "ZeRO-2's host time per step for GPT-2 small's layers, docs/benchmarks.md engine_overhead). On one "
                  "device use distributed.zero_stage=2, or keep 3 with distributed.offload_params=true to hold more "
                  "than the device's memory.")

#: torch.compile modes that capture and replay CUDA graphs (``torch._inductor.list_mode_options``: triton.cudagraphs).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _micro_batch(cfg: Any) -> int:
    return int(cfg.data.micro_batch_size)


def split_batch(micro_cap: int, accum: int, global_batch: int, world_size: int, *,
                key: str = "train.global_batch_size") -> tuple[int, int, int]:
    """(micro batch, gradient accumulation, global batch) of one optimizer step on ``world_size`` ranks.

    ``global_batch`` 0: the micro batch and accumulation as given. Otherwise the global batch holds whatever
    the number of ranks (Megatron-LM's ``--global-batch-size``): each rank takes ``global_batch / world_size``
    samples a step, in micro-batches of the largest size <= ``micro_cap`` (what one forward may take: memory)
    that divides its share, accumulated over the rest -- so a recipe keeps its paper's batch, and the learning
    rate tuned for it, on one GPU or on 64, and a run resumed on another number of GPUs goes on with the same batch.
    """
    if not global_batch:
        return micro_cap, accum, micro_cap * accum * world_size
    per_rank, rest = divmod(global_batch, world_size)
    if rest or per_rank < 1:
        raise ConfigError(f"{key} {global_batch} does not divide over {world_size} ranks (one per GPU or process). Use a "
                          f"multiple of {world_size}, or a number of ranks that divides {global_batch}.")
    micro = max(d for d in range(1, min(micro_cap, per_rank) + 1) if per_rank % d == 0)
    return micro, per_rank // micro, global_batch


def one_graph_per_block(cfg: Any, world_size: int, overlaps: bool) -> bool:
    """``model.compile_regions`` resolved (``model_build.compile_each_block_``). ``overlaps``: DeepSpeed ZeRO-1/2 would
    reduce gradient buckets during the backward if the compiled graph let it (``bucket_overlap`` not compiled, or a
    JSON's ``overlap_comm``). Auto compiles block by block exactly there: a whole-model graph's backward is one
    autograd node, whose gradients all reach DeepSpeed's hooks once it ends. DDP needs no split (dynamo cuts its graph
    at DDP's buckets); a model in one bucket, or on one rank, has nothing to overlap. Nor does auto split a graph
    that CUDA graphs replay (``compile_mode`` reduce-overhead or max-autotune, ``triton.cudagraphs``): untried with
    DeepSpeed's side stream."""
    m, d = cfg.model, cfg.distributed
    if not m.compile or m.compile_regions == "model":
        return False
    cudagraphs = m.compile_mode in ("reduce-overhead", "max-autotune") or bool(m.compile_options.get("triton.cudagraphs"))
    return m.compile_regions == "blocks" or (d.engine == "deepspeed" and d.zero_stage in (1, 2) and world_size > 1
                                             and overlaps and not cudagraphs)


def zero_overlap(cfg: Any, world_size: int, param_numel: int, bucket: int) -> tuple[bool, bool]:
    """(whether ZeRO-1/2's bucket reductions can overlap the backward, whether the model compiles block by block so
    that they do): the rule the engine's DeepSpeed JSON and ``pretrain plan`` share (GPUs assumed)."""
    stage = cfg.distributed.zero_stage
    per_block = one_graph_per_block(cfg, world_size, bucket_overlap(stage, world_size, False, param_numel, bucket))
    return bucket_overlap(stage, world_size, bool(cfg.model.compile) and not per_block, param_numel, bucket), per_block


def bucket_overlap(stage: int, world_size: int, compiled: bool, param_numel: int, bucket: int) -> bool:
    """Whether DeepSpeed's ``overlap_comm`` can overlap anything (the rule the engine's JSON and ``pretrain plan``
    share; ``distributed.overlap_comm`` says why): under ZeRO-1/2 only on several ranks, not compiled as one graph
    (``compiled``; block by block is as eager), with more gradients than one bucket of ``bucket`` elements
    (``param_numel`` 0: unknown); ZeRO-0/3 keep it on several ranks."""
    if world_size <= 1:
        return False
    if stage not in (1, 2):
        return True
    return not compiled and (not param_numel or param_numel > bucket)


def batch_split(cfg: Any, world_size: int) -> tuple[int, int, int]:
    """``split_batch`` of a run config (``data.micro_batch_size``, ``train.grad_accum_steps``, ``train.global_batch_size``)."""
    return split_batch(_micro_batch(cfg), int(cfg.train.grad_accum_steps), int(getattr(cfg.train, "global_batch_size", 0)),
                       world_size)


def apply_batch_split(cfg: Any, world_size: int) -> str | None:
    """Set the run's micro batch and accumulation for ``world_size`` ranks from ``train.global_batch_size``
    (a no-op without it, and on a config it was applied to); returns a line saying what was set, if anything."""
    if not getattr(cfg.train, "global_batch_size", 0):
        return None
    asked = (_micro_batch(cfg), cfg.train.grad_accum_steps)
    micro, accum, total = batch_split(cfg, world_size)
    cfg.data.micro_batch_size, cfg.train.grad_accum_steps = micro, accum
    line = (f"train.global_batch_size {total} on {world_size} rank(s): data.micro_batch_size {micro} x "
            f"train.grad_accum_steps {accum} per rank")
    if micro != asked[0]:
        line += f" (data.micro_batch_size {asked[0]} is the most one forward takes; {micro} divides the rank's {total // world_size})"
    if asked[1] not in (1, accum):
        line += f"; the config's train.grad_accum_steps {asked[1]} is replaced (the global batch decides it)"
    return line + "."


def _check_distributed(cfg: Any, world_size: int) -> None:
    d, t = cfg.distributed, cfg.train
    if world_size < 1:
        raise ConfigError(f"The job needs at least one process, got a world size of {world_size}.")
    if _micro_batch(cfg) < 1:
        raise ConfigError(f"data.micro_batch_size must be >= 1, got {_micro_batch(cfg)}.")
    mb, accum, global_batch = batch_split(cfg, world_size)
    if d.engine == "ddp" and (d.offload_optimizer or d.offload_params):
        raise ConfigError("distributed.offload_optimizer/offload_params need engine=deepspeed (ZeRO-Offload); plain DDP cannot offload.")
    compile_ = getattr(getattr(cfg, "model", None), "compile", False)
    if d.engine == "deepspeed" and d.zero_stage == 3 and compile_:
        raise ConfigError(
            "model.compile=true is not supported with distributed.zero_stage=3 in this engine (ZeRO-3 gathers parameters "
            "with module hooks that torch.compile graph-breaks on). Use zero_stage<=2 or compile=false."
        )
    model = getattr(cfg, "model", None)
    mode = getattr(model, "compile_mode", "default")
    graphs = (f"model.compile_mode={mode}" if mode in CUDA_GRAPH_MODES else "model.compile_options.triton.cudagraphs"
              if (getattr(model, "compile_options", None) or {}).get("triton.cudagraphs") else "")  # what those modes set
    if compile_ and graphs and accum > 1:
        derived = (f" (train.global_batch_size {global_batch} over {world_size} rank(s) in micro-batches of {mb})"
                   if t.global_batch_size else "")
        raise ConfigError(
            f"{graphs} replays CUDA graphs, and with train.grad_accum_steps={accum}{derived} the "
            f"gradients of one micro-batch live in the graph's memory that the next replay overwrites (torch's cudagraph "
            f"trees hand their backward outputs to autograd as the .grad buffers: an error at best, silently wrong "
            f"accumulated gradients on some torch versions, pytorch/pytorch#96693, #169545). Use one micro-batch per "
            f"step (a larger data.micro_batch_size, or a smaller train.global_batch_size / more processes) or "
            + ("compile_mode=default / max-autotune-no-cudagraphs." if graphs.startswith("model.compile_mode")
               else "compile_options without triton.cudagraphs.")
        )
    chunked = (getattr(getattr(cfg, "model", None), "overrides", None) or {}).get("loss_chunk_tokens", 0)
    if d.engine == "deepspeed" and d.zero_stage == 3 and chunked:
        raise ConfigError(
            f"model.overrides.loss_chunk_tokens={chunked} is not supported with distributed.zero_stage=3 (the chunked loss "
            f"reads the LM-head weight outside its module's forward, where ZeRO-3 has not gathered it). Use zero_stage<=2 "
            f"or remove loss_chunk_tokens."
        )
    if d.offload_optimizer and d.zero_stage == 0:
        raise ConfigError("distributed.offload_optimizer needs distributed.zero_stage >= 1 (ZeRO-Offload partitions the optimizer).")
    if d.deepspeed_config:
        if d.engine != "deepspeed":
            raise ConfigError(f"distributed.deepspeed_config={d.deepspeed_config} is set but distributed.engine={d.engine}. "
                              "Set distributed.engine=deepspeed or remove distributed.deepspeed_config.")
        path = Path(d.deepspeed_config)
        try:
            base = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"distributed.deepspeed_config={path} cannot be read as JSON ({exc}). Fix the path or the file.") from None
        if not isinstance(base, dict):
            raise ConfigError(f"distributed.deepspeed_config={path} must hold a JSON object.")
        if "optimizer" in base or "scheduler" in base:
            raise ConfigError(f"{path}: remove its `optimizer`/`scheduler` sections; optim.* and schedule.* build them.")
        for key, ours, explain in (
            ("train_micro_batch_size_per_gpu", mb, f"data.micro_batch_size {mb}"),
            ("gradient_accumulation_steps", accum, f"train.grad_accum_steps {accum}"),
            ("train_batch_size", global_batch,
             f"micro_batch_size {mb} x grad_accum_steps {accum} x world size {world_size} = {global_batch}"),
        ):
            theirs = base.get(key, "auto")
            if theirs != "auto" and theirs != ours:
                raise ConfigError(
                    f"{path}: {key}={theirs!r} != {explain}. Set `{key}` to \"auto\" in the JSON (the run config "
                    f"fills it) or change data.micro_batch_size / train.grad_accum_steps / the number of processes."
                )


def check(cfg: Any, *, world_size: int = 1) -> None:
    """Raise ``ConfigError`` (naming the key and the fix) for anything that would fail after launch.

    ``cfg`` is a ``RunConfig`` or a fine-tuning config (same sections, no ``model``); ``world_size``
    is the number of processes the job will have.
    """
    check_registry_names(cfg)  # optim.name, train.task, ...: a config built in code skipped the load's check
    _check_model(cfg)
    _check_schedule(cfg)
    _check_distributed(cfg, world_size)


def _check_corpus(path: str, cfg: Any, world_size: int, evaluated: bool = False) -> None:
    """A prepared corpus (its manifest) that gives every rank at least one micro-batch; the evaluated one
    (the first), if of images, stored so that the evaluation sees what the release's processor will."""
    from core.corpus import DataError, read_manifest
    from core.families.vit import stored_geometry_problem

    raw = read_manifest(path)  # names the missing or damaged manifest and the fix
    problem = stored_geometry_problem(raw, cfg.data.image_size) if evaluated and raw.get("kind") == "images" else None
    if problem:  # ImageClsTask refuses it too; here before any process starts
        raise DataError(f"{Path(path) / 'manifest.json'} {problem}.")
    samples = int(raw.get("splits", {}).get("train", {}).get("samples", 0))
    micro = batch_split(cfg, world_size)[0]
    need = world_size * micro
    if samples < need:
        raise ConfigError(
            f"The corpus {path} has {samples} training samples, fewer than one micro-batch per rank "
            f"(world size {world_size} x data.micro_batch_size {micro} = {need}). "
            f"Lower data.micro_batch_size or the number of processes, or prepare more data."
        )


def _input_paths(cfg: Any) -> list[tuple[str, str]]:
    """(key, path) of every file or corpus the job reads; an empty one is a config error, dry run or not."""
    if not is_pretraining_task(cfg.train.task):  # fine-tuning
        found = [("data.train", cfg.data.train), ("data.validation", cfg.data.validation)]
        hint = "a file of labelled examples, or for image_classification a folder of class folders (see docs/finetune.md)"
    elif cfg.data.corpora:
        found = [(f"data.corpora[{i}].path", part.path) for i, part in enumerate(cfg.data.corpora)]
        hint = "a corpus directory written by `pretrain prepare`"
    else:
        found, hint = [("data.corpus", cfg.data.corpus)], "a corpus directory written by `pretrain prepare`"
    for key, value in found:
        if not value:
            raise ConfigError(f"{key} is empty. Set it to {hint}.")
    return found


def check_inputs(cfg: Any, *, world_size: int = 1, strict: bool = True) -> list[str]:
    """Check that the files the job reads exist: the corpus (or every corpus of a mixture) and its size
    for ``world_size`` ranks, or fine-tuning's ``data.train`` / ``data.validation``.

    ``strict`` raises ``ConfigError``; otherwise (``submit --dry-run``, where the paths may be the
    cluster's) a missing or too small input comes back as a warning line. An empty path always raises.
    """
    from pipelines.engine.registries import TASKS

    warnings = []
    folders = cfg.train.task in TASKS.names() and TASKS[cfg.train.task].data_folders
    for i, (key, path) in enumerate(_input_paths(cfg)):
        try:
            if key.startswith(("data.corpus", "data.corpora")):
                _check_corpus(path, cfg, world_size, evaluated=i == 0)
            elif folders:  # image_classification: a folder of class folders, which the fine-tuning's reader checks
                if not Path(path).is_dir():
                    what = "is a file, not a folder" if Path(path).exists() else "does not exist"
                    raise ConfigError(f"{key}={path} {what}. Point {key} at a folder holding one sub-folder of images "
                                      f"per class ({key.split('.')[1]}/<class>/<image>.png; a path every node sees, for a "
                                      f"cluster job).")
            elif Path(path).is_dir():
                raise ConfigError(f"{key}={path} is a directory, not a file. Point {key} at the file of examples in it.")
            elif not Path(path).is_file():
                raise ConfigError(f"{key}={path}: no such file. Point {key} at an existing file "
                                  f"(a path on a filesystem every node sees, for a cluster job).")
        except ConfigError as exc:
            if strict:
                raise
            warnings.append(f"{exc} (a dry run renders anyway)")
    return warnings


def check_run_dir(cfg: Any) -> None:
    """``train.run_dir`` must be new, empty or a run dir of ours: refused here, once, before any rank starts and before
    fine-tuning reads its data (the ranks' own refusal came after a launch, as several lines)."""
    from core.files import check_output_dir

    check_output_dir(cfg.train.run_dir, "run", what="train.run_dir", reuse=True)


#: accelerate's ``mixed_precision`` values a run can honour -> ``train.precision`` (fp8 needs Transformer
#: Engine / MS-AMP / torchao kernels our models do not use).
ACCELERATE_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def check_accelerate_file(path: str | Path) -> None:
    """Refuse an ``accelerate launch --config_file`` file whose settings a run cannot honour, before
    accelerate's launcher starts (it fails on ``mixed_precision: fp8`` with a traceback of its own)."""
    from core.config import load_yaml

    data = load_yaml(path)
    mp = str(data.get("mixed_precision", "no")).lower()
    if mp not in ACCELERATE_PRECISION:
        raise ConfigError(
            f"{path}: mixed_precision: {mp} is not supported (our models run fp32, bf16 or fp16). Set it to "
            f"'no', bf16 or fp16 in that file, or remove it and set train.precision in the run config."
        )
    ds = data.get("deepspeed_config") or {}
    for field, key in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
        device = str(ds.get(field, "none")).lower()
        if device not in ("none", "cpu"):
            raise ConfigError(f"{path}: deepspeed_config.{field}: {device} is not supported (only cpu offload). Remove "
                              f"it and set distributed.{key}=true in the run config for CPU offload.")

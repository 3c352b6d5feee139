"""The model a run trains: ``models.create`` with what the data imposes, checked against the family spec.

``build_model`` is shared by pretraining (``trainer.train``) and the benchmarks; ``model.init_from``
starts from another checkpoint's full weights; ``preferred_attention`` sets the attention kernel a run tries first;
``compile_each_block_`` compiles a model's blocks one graph each (``model.compile_regions``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from core import families
from core.config import ConfigError
from core.registry import did_you_mean
from pipelines.engine.config import RunConfig

__all__ = ["ATTENTION_KERNELS", "build_model", "compile_blocks_if", "compile_each_block_", "compile_kwargs", "flops_per_sample",
           "preferred_attention"]

log = logging.getLogger(__name__)

#: ``model.attention_backend`` -> the ``torch.nn.attention.SDPBackend`` a run tries first (besides ``auto``)
ATTENTION_KERNELS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def _is_release(path: Path) -> bool:
    """A transformers directory (``pretrain export``'s release or ``save_pretrained``'s), not a run or checkpoint."""
    return (path / "config.json").is_file() and not (path / "trainer_state.json").is_file() and not (path / "checkpoints").is_dir()


def _release_state_dict(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """A release's weights in our layout (``models.hf.from_hf``: safetensors or weights-only ``.bin``), vocabulary
    rows padded as ``model`` pads them."""
    import models

    try:
        ours, _report = models.hf.from_hf(path, pad_vocab_multiple=getattr(model.config, "pad_vocab_multiple", 1))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.init_from={path}: not a usable release ({str(exc).splitlines()[0].strip()}). Pass a "
                          f"directory written by `pretrain export` or `save_pretrained`, or a run dir.") from None
    return ours.state_dict()


def _check_same_tokenizer(path: str, source_tokenizer: Path, corpus_tokenizer: Path | None) -> None:
    """The weights' tokenizer (a release's or checkpoint's ``tokenizer.json``) must be the corpus's, byte for byte, as
    `pretrain prepare tokenizer.path=...` copies it: two tokenizers of the same size fit the same embedding table while
    their ids name other tokens. Not told (nothing refused) where either file is absent."""
    from core.files import sha256_file

    theirs, ours = source_tokenizer / "tokenizer.json", corpus_tokenizer / "tokenizer.json" if corpus_tokenizer else None
    if ours is None or not theirs.is_file() or not ours.is_file() or sha256_file(theirs) == sha256_file(ours):
        return
    raise ConfigError(f"model.init_from={path} was trained with another tokenizer than the corpus ({theirs} differs from "
                      f"{ours}): its token ids would mean other tokens here. Prepare the corpus with the weights' "
                      f"tokenizer (pretrain prepare ... tokenizer.path={source_tokenizer}).")


def _init_from(model: torch.nn.Module, path: str, corpus_tokenizer: Path | None = None) -> None:
    """Load a checkpoint's (or a release's) full weights into ``model`` (every key must match: same architecture)
    after checking they were trained with the corpus's tokenizer."""
    from pipelines.engine.export import consolidated_state_dict, resolve_checkpoint

    if _is_release(Path(path)):  # continued pretraining from a release: ours, or a transformers GPT-2 / BERT
        _check_same_tokenizer(path, Path(path), corpus_tokenizer)
        state = _release_state_dict(model, Path(path))
        hint = (f"Build the release's architecture (model.name and model.overrides as its config.json gives them) on a "
                f"corpus prepared with its tokenizer (tokenizer.path={path}).")
    else:
        ckpt = resolve_checkpoint(path)
        _check_same_tokenizer(path, Path(ckpt) / "tokenizer", corpus_tokenizer)
        hint = f"Use the same model.name and model.overrides as the run that wrote it{_written_by(Path(ckpt))}."
        state = consolidated_state_dict(ckpt)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        raise ConfigError(f"model.init_from={path}: {str(exc).splitlines()[-1].strip()} {hint}") from None
    tied = {k for k in missing if k.endswith(("decoder.weight", "lm_head.weight"))}
    if set(missing) - tied or unexpected:
        raise ConfigError(f"model.init_from={path}: the checkpoint's weights do not fit model.name (missing "
                          f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}). {hint}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _written_by(checkpoint: Path) -> str:
    """``: model.name=X, model.overrides={...} (its config.yaml)`` from the checkpoint's saved run config, or ""."""
    import yaml

    try:
        model = (yaml.safe_load((checkpoint / "config.yaml").read_text(encoding="utf-8")) or {}).get("model") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return ""
    if not model.get("name"):
        return ""
    return (f": model.name={model['name']}, model.overrides={model.get('overrides') or {}} "
            f"({checkpoint / 'config.yaml'})")


def build_model(cfg: RunConfig, task: Any, tokenizer_dir: Path | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``models.create`` with the fields the data imposes (vocab, labels, image size); returns (model, build args).
    ``tokenizer_dir``: the corpus's tokenizer, which ``model.init_from``'s weights must have been trained with."""
    import models

    overrides = dict(cfg.model.overrides)
    try:
        fields = {f.name for f in dataclasses.fields(models.get_config(cfg.model.name))}
    except ValueError as exc:
        raise ConfigError(f"model.name: {exc}") from None
    for key, value in task.model_overrides().items():
        if key not in fields:
            continue
        if key in overrides and overrides[key] != value:
            raise ConfigError(
                f"model.overrides.{key}={overrides[key]!r} disagrees with the data ({value!r}, from the corpus manifest / "
                f"data config). Remove the override or prepare matching data."
            )
        overrides[key] = value
    if cfg.model.pad_vocab_multiple != 1 and "pad_vocab_multiple" in fields:  # models without a vocabulary: no-op
        overrides.setdefault("pad_vocab_multiple", cfg.model.pad_vocab_multiple)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    try:
        model = models.create(cfg.model.name, **overrides)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model.overrides: {exc}") from None
    if cfg.model.init_from:
        _init_from(model, cfg.model.init_from, tokenizer_dir)
    family = families.family_of_model(cfg.model.name)
    if task.name in families.pretraining_tasks() and task.name not in family.tasks:
        need = " or ".join(spec.name for spec in families.families_for_task(task.name))
        raise ConfigError(f"train.task={task.name} needs a {need} model; model.name={cfg.model.name} is a {family.name} model.")
    seq_len = getattr(task, "seq_len", 0)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if seq_len and max_pos is not None and max_pos < seq_len:
        raise ConfigError(f"The corpus seq_len {seq_len} exceeds model max_position_embeddings {max_pos}; raise it in model.overrides.")
    if cfg.model.activation_checkpointing:
        if not hasattr(model, "set_activation_checkpointing"):
            raise ConfigError(f"model.activation_checkpointing: {cfg.model.name} does not support it.")
        model.set_activation_checkpointing(True)
    return model, {"name": cfg.model.name, "overrides": overrides}


def flops_per_sample(model_config: Any, task: Any) -> float:
    """Training FLOPs of one sample (the MFU's numerator); 0 where the model has no FLOP count."""
    try:
        from models.flops import training_flops_per_sample

        return float(training_flops_per_sample(model_config, **task.flops_kwargs()))
    except Exception:  # noqa: BLE001 - MFU is optional (custom models have no FLOP count)
        return 0.0


@contextlib.contextmanager
def preferred_attention(name: str) -> Iterator[None]:
    """``model.attention_backend``: while the run lasts, ``scaled_dot_product_attention`` tries ``name``'s kernel first,
    then the others in torch's own order, so a call that kernel cannot serve (flash and a padding mask) falls back
    as it would with every kernel allowed; ``auto`` leaves torch's order. It holds for the whole run, because
    torch.compile bakes the kernel SDPA picks while tracing (the first forward) into the graph. Why prefer one:
    torch's order differs between builds (cuDNN first on Hopper in some, flash in others) and so do the kernels'
    speeds on a card (benchmarks/attention_backends.py, docs/benchmarks.md). On the CPU the selector has flash and
    math only and does not read the order."""
    if name == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if torch.cuda.is_available():  # CUDA's selector writes its default order (cuDNN first on some builds and cards) at
        # its first call in a process, over whatever order was set before it: have it do so now, so the order read
        # below is torch's real one and the one set after it stays
        probe = torch.zeros(1, 1, 16, 64, device="cuda", dtype=torch.float16)
        torch._fused_sdp_choice(probe, probe, probe)
    try:  # the priority order is torch >= 2.6's (sdpa_kernel's set_priority)
        from torch.nn.attention import _cur_sdpa_kernel_backends

        current = _cur_sdpa_kernel_backends(with_priority=True)
    except (ImportError, TypeError):
        raise ConfigError(f"model.attention_backend={name} needs torch >= 2.6 (a priority order for attention kernels); "
                          f"this is torch {torch.__version__}. Use model.attention_backend=auto.") from None
    first = getattr(SDPBackend, ATTENTION_KERNELS[name])
    with sdpa_kernel([first] + [b for b in current if b != first], set_priority=True):
        yield


def compile_each_block_(model: torch.nn.Module, compile_kwargs: dict[str, Any]) -> int:
    """Compile every block of the model's ``blocks`` stacks on its own, in place (parameter names unchanged), and
    mark the stacks so that ``models.layers.run_blocks`` keeps their loop out of the model's own compiled graph:
    compiled afterwards, the model is one graph before the blocks, one per block and one after them. Why: the
    backward of one compiled graph is one autograd node, and DeepSpeed's ZeRO-1/2 gradient hooks then all fire once
    it ends, so no bucket reduction overlaps the backward (benchmarks/comm_overlap.py, a 2-block GPT: 0 of 5 compiled
    whole, 1 block by block, 2 eager; tests/pipelines/test_compile_regions.py); torchtitan compiles its blocks one by
    one for the same reason (FSDP's per-block hooks). Identical blocks share one compiled graph. Returns the number of
    stacks (0: no ``blocks`` to split)."""
    from models.layers import ONE_GRAPH_PER_BLOCK, loop_blocks

    stacks = [m for name, m in model.named_modules()
              if name.rpartition(".")[2] == "blocks" and isinstance(m, torch.nn.ModuleList)]
    outside_the_graph = torch.compiler.disable(loop_blocks)  # each block's own compiled graph runs inside
    for stack in stacks:
        for block in stack:
            block.compile(**compile_kwargs)
        setattr(stack, ONE_GRAPH_PER_BLOCK, outside_the_graph)
    return len(stacks)


def compile_kwargs(cfg: Any) -> dict[str, Any]:
    """``torch.compile``'s arguments: the mode, or inductor options in its place (names checked against this torch's: a
    misspelt one stops the run here, not at its first forward); with ``data.fixed_shapes`` static graphs only."""
    dynamic = False if cfg.data.fixed_shapes else None
    options = dict(cfg.model.compile_options)
    if not options:
        return {"mode": cfg.model.compile_mode, "dynamic": dynamic}
    from torch._inductor import list_options

    known = list_options()
    for name in (n for n in options if n not in known):
        raise ConfigError(f"model.compile_options: torch {torch.__version__}'s inductor has no option `{name}`."
                          f"{did_you_mean(name, known)} Names are flat and dotted ({{triton.cudagraphs: true}}, not "
                          f"{{triton: {{cudagraphs: true}}}}); torch._inductor.list_options() lists them.")
    return {"options": options, "dynamic": dynamic}


def compile_blocks_if(per_block: bool, model: torch.nn.Module, cfg: Any, kwargs: dict[str, Any]) -> None:
    """``model.compile_regions`` (``check.one_graph_per_block``): the blocks compiled one graph each (``kwargs``: the
    run's ``compile_kwargs``) before the model is compiled around them; a model without ``blocks`` to split is
    compiled whole, and said so."""
    if not per_block:
        return
    if compile_each_block_(model, kwargs):
        log.info("model.compile_regions=%s: %s compiled one graph per block, so that its gradients are reduced during "
                 "the backward", cfg.model.compile_regions, cfg.model.name)
    elif cfg.model.compile_regions == "blocks":
        raise ConfigError(f"model.compile_regions=blocks: {cfg.model.name} has no `blocks` module list looped with "
                          f"models.layers.run_blocks to compile one by one. Use model.compile_regions=auto or model.")
    else:
        log.info("%s has no `blocks` to compile one by one: compiled as one graph, so its gradient reduction waits "
                 "for the whole backward", cfg.model.name)

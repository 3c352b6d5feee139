"""Checkpoint -> transformers-loadable release directory (``pretrain export CKPT OUT``).

ZeRO partitions of any stage are consolidated into one fp32 state dict (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint`` for stages 1-3, the engine's module file for stage 0,
``engine/model.pt`` for the DDP engine), loaded into the registered model, converted with
``models.hf.to_hf`` and saved as ``model.safetensors`` + ``config.json``, with the tokenizer files
(or, for ViT, a ``preprocessor_config.json``) and a model card ``README.md``. The directory is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from core.config import ConfigError
from core.files import atomic_write_text

__all__ = ["export_checkpoint", "consolidated_state_dict", "resolve_checkpoint", "write_release", "tokenizer_special_ids"]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint dir, or a run dir (its ``checkpoints/latest``)."""
    p = Path(path)
    if (p / "trainer_state.json").is_file():
        return p
    from pipelines.engine.checkpoint import find_resume

    found = find_resume(p, "auto") if (p / "checkpoints").is_dir() else None
    if found is None:
        raise ConfigError(f"{p} is neither a checkpoint (no trainer_state.json) nor a run directory with complete checkpoints. "
                          f"Pass run_dir/checkpoints/step-NNNNNNNN.")
    return found


def consolidated_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of a checkpoint, whatever engine/ZeRO stage wrote it."""
    engine = ckpt / "engine"
    if (engine / "model.pt").is_file():  # DDP engine
        sd = torch.load(engine / "model.pt", map_location="cpu", weights_only=True)
        return {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
    if list(engine.glob("*zero_pp_rank_*optim_states.pt")) and not _stage0(engine):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="engine")
    files = sorted(engine.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ConfigError(f"{engine} holds no model states; the checkpoint is incomplete. Export another checkpoint.")
    states = torch.load(files[0], map_location="cpu", weights_only=True)  # ZeRO-0: the full module, replicated
    return {k: v.float() for k, v in states["module"].items()}


def _stage0(engine: Path) -> bool:
    state = json.loads((engine.parent / "trainer_state.json").read_text(encoding="utf-8"))
    return state.get("zero_stage") == 0


def _model_card(state: dict[str, Any], ckpt: Path, arch: str) -> str:
    info = state.get("data_info", {})
    ev = state.get("eval") or {}
    metrics = "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(ev.items()) if isinstance(v, (int, float))) or "| (none) | |"
    build = state.get("model_build", {})
    return f"""---
library_name: transformers
tags: [pretrain, {state.get("task", "")}]
---
# {build.get("name", "model")} ({arch})

Pretrained with the `pretrain` pipeline (objective `{state.get("task")}`), exported from `{ckpt}`.

## Data
- corpus: `{info.get("corpus", "?")}` (kind `{info.get("kind", "?")}`, seq_len {info.get("seq_len", "?")})
- samples per split: {json.dumps(info.get("splits", {}))}
- tokens per split: {json.dumps(info.get("tokens", {}))}
- tokenizer: {json.dumps({k: v for k, v in (info.get("tokenizer") or {}).items() if k in ("type", "vocab_size", "sha256")})}

## Training
- optimizer steps: {state.get("step")}
- tokens seen: {state.get("tokens")} (images for image models)
- samples seen: {state.get("samples")}
- world size: {state.get("world_size")}, engine: {state.get("engine")}, ZeRO stage: {state.get("zero_stage")}, precision: {state.get("precision")}
- model overrides: `{json.dumps(build.get("overrides", {}))}`
- loss: first step {state.get("start_loss")}, last step {state.get("last_loss")}

## Final evaluation
| metric | value |
|---|---|
{metrics}

## Use
```python
from transformers import AutoModel
model = AutoModel.from_pretrained("{'{'}this directory{'}'}")
```
"""


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Consolidate ``checkpoint_dir`` (or a run dir's latest) into a release dir at ``out_dir``; returns it."""
    import models

    ckpt = resolve_checkpoint(checkpoint_dir)
    state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
    build = state.get("model_build") or {}
    if not build.get("name"):
        raise ConfigError(f"{ckpt}/trainer_state.json has no model_build entry; it was not written by pipelines.engine.trainer.")
    model = models.create(build["name"], **build.get("overrides", {}))
    sd = consolidated_state_dict(ckpt)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if k.endswith("decoder.weight") or k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{ckpt}: weights do not match {build['name']} (missing {sorted(set(missing) - tied)}, "
                          f"unexpected {sorted(unexpected)}). Was the checkpoint written by another model config?")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    hf = models.hf.to_hf(model.float().eval())
    class_map = (state.get("data_info") or {}).get("class_map") or {}
    if class_map and hasattr(hf.config, "id2label"):
        hf.config.id2label = {int(v): k for k, v in class_map.items()}
        hf.config.label2id = {k: int(v) for k, v in class_map.items()}
    extra = {}
    if getattr(model, "family", "") == "vit":
        from pipelines.engine.objectives import ImageClsTask

        extra["preprocessor_config.json"] = json.dumps(ImageClsTask.eval_processor_config(model.config.image_size), indent=2)
    card = _model_card(state, ckpt, type(hf).__name__)
    return write_release(hf, out_dir, tokenizer_dir=ckpt / "tokenizer", card=card, extra_files=extra)


#: Files a tokenizer directory may hold; copied into releases (never a model's own weights/config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "added_tokens.json")


def tokenizer_special_ids(tokenizer_dir: str | os.PathLike) -> dict[str, int | None] | None:
    """``{bos,eos,pad,unk,mask,cls,sep}_token_id`` as the tokenizer in ``tokenizer_dir`` defines them (None: no tokenizer)."""
    from models.hf import SPECIAL_ID_NAMES

    d = Path(tokenizer_dir)
    if not any((d / name).is_file() for name in ("tokenizer.json", "vocab.txt", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
    return {name: getattr(tok, name, None) for name in SPECIAL_ID_NAMES}


def write_release(hf: Any, out_dir: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None,
                  card: str = "", extra_files: dict[str, str] | None = None) -> Path:
    """Save a transformers model + tokenizer files + model card as ``out_dir``, atomically.

    Everything is written into a temporary sibling directory, fsynced, then renamed over ``out_dir``
    (an existing release is replaced only once the new one is complete). The config and generation
    config take every special-token id from the tokenizer copied with it.
    """
    import models

    out = Path(out_dir)
    ids = tokenizer_special_ids(tokenizer_dir) if tokenizer_dir is not None and Path(tokenizer_dir).is_dir() else None
    if ids is not None:
        models.hf.set_special_ids(hf, ids)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf.save_pretrained(str(tmp), safe_serialization=True)
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
    for name, text in (extra_files or {}).items():
        atomic_write_text(tmp / name, text)
    if card:
        atomic_write_text(tmp / "README.md", card)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out.exists():
        old = out.parent / f".old-{out.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out

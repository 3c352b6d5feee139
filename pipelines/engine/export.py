"""Checkpoint -> transformers-loadable release directory (``pretrain export CKPT OUT``).

ZeRO partitions of any stage are consolidated into one fp32 state dict (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint`` for stages 1-3, the engine's module file for stage 0,
``engine/model.pt`` for the DDP engine), loaded into the registered model, converted with
``models.hf.to_hf`` and saved as ``model.safetensors`` + ``config.json``, with the tokenizer files
(or, for ViT, a ``preprocessor_config.json``) and a model card ``README.md``. The directory is
written under a temporary name and renamed when complete.

Safety: the checkpoint is verified against the sizes and sha256s in its ``trainer_state.json`` and
every file is loaded with ``weights_only=True`` (``models.safe_load``), DeepSpeed's consolidation included.
The destination must be new, empty, or a release we wrote (``.pretrain-output.json``), which is
replaced only with ``overwrite`` and only once the new one is complete; a destination inside the
checkpoint's run directory (or containing it) is refused.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from core.config import ConfigError
from core.families import family_of_model
from core.files import MARKER, atomic_write_text, check_output_dir, copy_file, replace_dir
from pipelines.engine.release_card import model_card

log = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "consolidated_state_dict", "resolve_checkpoint", "write_release", "tokenizer_special_ids"]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint dir, or a run dir (its ``checkpoints/latest``; a damaged one is reported, not skipped)."""
    p = Path(path)
    if (p / "trainer_state.json").is_file():
        return p
    if not p.exists():
        raise ConfigError(f"{p} does not exist. Pass a run directory (train.run_dir of a pretraining run) or one of its "
                          f"checkpoints, run_dir/checkpoints/step-NNNNNNNN.")
    from pipelines.engine.checkpoint import list_checkpoints

    found = list_checkpoints(p)  # the newest (as `latest` names it); verified by the caller, never skipped
    latest = p / "checkpoints" / "latest"
    named = p / "checkpoints" / latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
    found = named if named in found else (found[-1] if found else None)
    if found is None:
        raise ConfigError(f"{p} is neither a checkpoint (no trainer_state.json) nor a run directory with complete checkpoints. "
                          f"Pass run_dir/checkpoints/step-NNNNNNNN.")
    return found


def consolidated_state_dict(ckpt: Path) -> dict[str, Any]:
    """The full fp32 model state dict of a checkpoint, whatever engine/ZeRO stage wrote it (verified, weights only)."""
    from models.safe_load import safe_torch_load, weights_only_loads
    from pipelines.engine.checkpoint import verify_checkpoint

    state = verify_checkpoint(ckpt)
    engine = ckpt / "engine"
    if (engine / "model.pt").is_file():  # DDP engine
        sd = safe_torch_load(engine / "model.pt", map_location="cpu")
        return {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
    partitions = sorted(engine.glob("*zero_pp_rank_*optim_states.pt"))
    if partitions and state.get("zero_stage") != 0:
        from pipelines.engine.distributed import quiet_libraries

        quiet_libraries()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        log.info("Consolidating %s: ZeRO-%s, %d partition file(s)", ckpt, state.get("zero_stage"), len(partitions))
        printed = io.StringIO()  # its print()s ("Detected checkpoint of type ...") and tqdm bar go to the debug log
        try:
            with weights_only_loads(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="engine")  # its loader asks for weights_only=False
        finally:
            log.debug("DeepSpeed's consolidation of %s printed:\n%s", ckpt, printed.getvalue())
    files = sorted(engine.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ConfigError(f"{engine} holds no model states; the checkpoint is incomplete. Export another checkpoint.")
    states = safe_torch_load(files[0], map_location="cpu")  # ZeRO-0: the full module, replicated
    return {k: v.float() for k, v in states["module"].items()}


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _refuse_overlap(ckpt: Path, out: Path) -> None:
    """The release may not be (or contain, or sit inside) the checkpoint's run directory."""
    run_dir = ckpt.resolve().parent.parent if ckpt.resolve().parent.name == "checkpoints" else ckpt.resolve()
    dest = out.resolve()
    if dest == run_dir or run_dir.is_relative_to(dest) or dest.is_relative_to(run_dir):
        raise ConfigError(f"Export destination {out} overlaps the run directory {run_dir} of checkpoint {ckpt}; "
                          f"writing there could replace the checkpoints. Choose a destination outside the run directory.")


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                      inside_run_dir: bool = False) -> Path:
    """Consolidate ``checkpoint_dir`` (or a run dir's latest) into a release dir at ``out_dir``; returns it.

    ``overwrite``: replace a release we wrote there before. ``inside_run_dir``: the caller writes into its
    own run directory (fine-tuning's ``base-release``), not the checkpoint's.
    """
    import models
    from pipelines.engine.checkpoint import read_trainer_state

    ckpt = resolve_checkpoint(checkpoint_dir)
    if not inside_run_dir:
        _refuse_overlap(ckpt, Path(out_dir))
    check_output_dir(out_dir, "release", what="Export destination", overwrite=overwrite)
    state = read_trainer_state(ckpt)  # every file is verified by consolidated_state_dict
    build = state.get("model_build") or {}
    if not build.get("name"):
        raise ConfigError(f"{ckpt}/trainer_state.json has no model_build entry; it was not written by pipelines.engine.trainer.")
    family = family_of_model(build["name"])
    if not family.exports:
        raise ConfigError(f"{ckpt}: model {build['name']} is of family `{family.name}`, whose spec declares no Hugging Face "
                          f"mapping (FamilySpec.hf_model_type is None), so it has no transformers release to export. "
                          f"Its checkpoint stays usable: resume from it or start a run from it with model.init_from. "
                          f"Nothing was written.")
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
    extra = family.release_files(model.config) if family.release_files else {}  # e.g. ViT's image processor
    card = model_card(state, ckpt, hf, model.family, str(out_dir))
    return write_release(hf, out_dir, tokenizer_dir=ckpt / "tokenizer", card=card, extra_files=extra, overwrite=overwrite)


#: Files a tokenizer directory may hold; copied into releases (never a model's own weights/config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "added_tokens.json")
#: One of these holds a tokenizer's vocabulary; without one, transformers 5's AutoTokenizer builds an empty one.
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")


def has_tokenizer(tokenizer_dir: str | os.PathLike) -> bool:
    """Whether ``tokenizer_dir`` holds a vocabulary (``VOCABULARY_FILES``), not only special tokens."""
    return any((Path(tokenizer_dir) / name).is_file() for name in VOCABULARY_FILES)


def tokenizer_special_ids(tokenizer_dir: str | os.PathLike) -> dict[str, int | None] | None:
    """``{bos,eos,pad,unk,mask,cls,sep}_token_id`` as the tokenizer in ``tokenizer_dir`` defines them (None: no tokenizer)."""
    from models.hf import SPECIAL_ID_NAMES

    d = Path(tokenizer_dir)
    if not has_tokenizer(d):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
    return {name: getattr(tok, name, None) for name in SPECIAL_ID_NAMES}


def write_release(hf: Any, out_dir: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None,
                  card: str = "", extra_files: dict[str, str] | None = None, overwrite: bool = True) -> Path:
    """Save a transformers model + tokenizer files + model card as ``out_dir``, atomically.

    Everything is written into a fresh temporary sibling directory (with the ``release`` marker),
    fsynced, then swapped in: an existing release we wrote is replaced (if ``overwrite``) only once the
    new one is complete; any other non-empty ``out_dir`` is refused before anything is written. The
    config and generation config take every special-token id from the tokenizer copied with it.
    """
    import models

    out = Path(out_dir)
    check_output_dir(out, "release", what="Release directory", overwrite=overwrite)
    ids = tokenizer_special_ids(tokenizer_dir) if tokenizer_dir is not None and Path(tokenizer_dir).is_dir() else None
    if ids is not None and ids.get("eos_token_id") is None and hf.can_generate():
        # `pretrain prepare` packs a GPT corpus with sep_token between documents when the tokenizer has no eos_token
        # (data_prep.job): that is the end of text the model learned, where generate() must stop.
        ids["eos_token_id"] = ids.get("sep_token_id")
    if ids is not None:
        models.hf.set_special_ids(hf, ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        with _no_progress_bar():  # one file written: transformers' "Writing model shards" bar says nothing
            hf.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / name
                if os.path.lexists(src):
                    copy_file(src, tmp / name, what="a tokenizer file")  # a link is refused, never followed
        for name, text in (extra_files or {}).items():
            atomic_write_text(tmp / name, text)
        if card:
            atomic_write_text(tmp / "README.md", card)
        atomic_write_text(tmp / MARKER, json.dumps({"kind": "release"}) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755 & ~_umask())  # mkdtemp makes 0700; releases are meant to be shared
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        if isinstance(exc, (OSError, SafetensorError)):  # disk full, quota, I/O error
            reason = next((line for line in str(exc).splitlines() if line.strip()), "")
            raise ConfigError(f"Writing the release {out} failed ({type(exc).__name__}: {reason}; "
                              f"{shutil.disk_usage(out.parent).free} bytes free there). Nothing was left half-written"
                              f"{' and the old release is untouched' if out.exists() else ''}. Free space under "
                              f"{out.parent} and export again.") from None
        raise
    check_output_dir(out, "release", what="Release directory", overwrite=overwrite)  # still ours (or gone)?
    replace_dir(tmp, out)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

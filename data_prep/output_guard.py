"""What `prepare` checks before it writes, and what it takes back when it fails on bad input.

A corpus directory is resumed (a killed job rebuilt byte-identically) only by the SAME config: the config a
finished corpus was built with is in its manifest (``prep_config``), a partial one's in ``.state/prep_config.json``
(written before the first shard). Any other config is refused, naming what differs, unless ``overwrite=true``
(prepare then replaces only the files it writes: manifest, shards, indexes, their records, tokenizer/).
An input error (``PrepError``, ``ConfigError``) in a directory this run created removes it again, so a failed
prepare leaves no empty, marked folder behind; a crash or a kill keeps everything for the resume.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.config import ConfigError
from core.corpus import SHARD_FILE_RE
from core.files import atomic_write_text, claim_output_dir, discard, output_kind
from data_prep.config import PrepConfig, manifest_config
from data_prep.errors import PrepError
from data_prep.shards import STATE_DIR

__all__ = ["CONFIG_RECORD", "check_reused_tokenizer", "claimed_corpus", "config_differences"]

CONFIG_RECORD = "prep_config.json"  # in STATE_DIR: the config of a corpus being written
# recorded, but no shard depends on them: a rerun that changes them (the bad-records message says "raise
# max_bad_fraction") goes on with the same shards
_NOT_IN_SHARDS = ("max_bad_fraction",)


def check_reused_tokenizer(cfg: PrepConfig) -> None:
    """A reused tokenizer (``tokenizer.path``) is read and checked against the kind before anything is written,
    so the message names the user's file, not the copy prepare would make of it."""
    if not cfg.tokenizer.path:
        return
    from data_prep.tokenizer import load_tokenizer_dir, missing_separator_error, special_ids

    tok, ttype = load_tokenizer_dir(cfg.tokenizer.path)
    src = Path(cfg.tokenizer.path)
    tdir = src if src.is_dir() else src.parent
    specials = special_ids(tdir, ttype, tok)
    if cfg.kind == "packed_lm" and not {"eos_token", "sep_token"} & specials.keys():
        raise missing_separator_error(tdir)
    if cfg.kind == "bert_pairs" and not {"cls_token", "sep_token"} <= specials.keys():
        raise PrepError(f"The tokenizer at tokenizer.path={cfg.tokenizer.path} has no [CLS]/[SEP] tokens; bert_pairs needs "
                        f"a WordPiece (BERT) tokenizer. Point tokenizer.path at one, or leave it empty to train one.")


def config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every (dotted) field that differs between two recorded prep configs."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}: {_short(a)} -> {_short(b)}")
    return out


def _short(value: Any, limit: int = 70) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _recorded_config(out: Path) -> tuple[dict[str, Any] | None, str]:
    """(the config ``out`` was or is being built with, the file that says so), or (None, "") when none is recorded."""
    for file, pick in ((out / "manifest.json", lambda raw: raw.get("prep_config")), (out / STATE_DIR / CONFIG_RECORD, dict)):
        if file.is_file():
            try:
                recorded = pick(json.loads(file.read_text(encoding="utf-8")))
            except (ValueError, UnicodeDecodeError, AttributeError, TypeError):
                recorded = None
            if isinstance(recorded, dict):
                return recorded, str(file)
    return None, ""


def _refuse_another_config(cfg: PrepConfig, out: Path) -> None:
    old, where = _recorded_config(out)
    if old is None:
        return
    new = manifest_config(cfg)
    diff = config_differences({k: v for k, v in old.items() if k not in _NOT_IN_SHARDS},
                              {k: v for k, v in new.items() if k not in _NOT_IN_SHARDS})
    if not diff:
        return
    state = "a finished corpus" if where.endswith("manifest.json") else "a partly written corpus"
    if not cfg.overwrite:
        shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
        raise PrepError(f"output={out} holds {state} built with another config ({where}): {shown}. prepare resumes "
                        f"only the same config; refusing to replace it. Choose another output folder, or pass "
                        f"overwrite=true to replace it (only the files prepare wrote there are removed).")
    _remove_prepare_files(out)


def _remove_prepare_files(out: Path) -> None:
    """What prepare writes in ``out`` (manifest first: the corpus is unfinished from then on), nothing else."""
    discard(out / "manifest.json")
    for p in out.iterdir():
        if SHARD_FILE_RE.match(p.name) or (p.name.startswith(".") and p.name.endswith(".tmp")):
            discard(p)
    discard(out / STATE_DIR)
    discard(out / "tokenizer")


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (what ``mkdir(parents=True)`` will create)."""
    missing = None
    for p in (path, *Path(os.path.abspath(path)).parents):
        if p.exists():
            break
        missing = p
    return missing


@contextlib.contextmanager
def claimed_corpus(cfg: PrepConfig, out: Path) -> Iterator[Path]:
    """Claim ``out`` as a corpus directory for this config (see the module docstring); yields it."""
    created = _first_missing(out)
    was_empty = created is None and out.is_dir() and not any(out.iterdir())
    claim_output_dir(out, "corpus", what="output (the corpus directory)")  # never a user's folder
    try:
        _refuse_another_config(cfg, out)
        atomic_write_text(out / STATE_DIR / CONFIG_RECORD, json.dumps(manifest_config(cfg), indent=1, sort_keys=True) + "\n")
        yield out
    except (PrepError, ConfigError):
        if created is not None:
            discard(created)  # every file in it is this run's
        elif was_empty and output_kind(out) == "corpus":
            for p in list(out.iterdir()):  # the user's empty folder stays, empty
                discard(p)
        raise

"""The model card (``README.md``) of a pretraining release.

The corpus kind says what the data was (text: sequence length, tokens and tokenizer; images: image
size and classes) and what "seen" counts (tokens or images); the family's spec
(``FamilySpec.card_usage``) says how to load the release in ``transformers`` with the class and
preprocessing that fit it: a snippet that runs as written from where ``pretrain export`` was run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.corpus_kinds import corpus_kind
from core.families import get_family

__all__ = ["model_card"]

_TOKENIZER_FIELDS = ("type", "vocab_size", "sha256")


def _text_data(info: dict[str, Any], model_config: Any) -> list[str]:
    tokenizer = {k: v for k, v in (info.get("tokenizer") or {}).items() if k in _TOKENIZER_FIELDS}
    return [
        f"- corpus: `{info.get('corpus', '?')}` (kind `{info.get('kind', '?')}`, seq_len {info.get('seq_len', '?')})",
        f"- samples per split: {json.dumps(info.get('splits', {}))}",
        f"- tokens per split: {json.dumps(info.get('tokens', {}))}",
        f"- tokenizer: {json.dumps(tokenizer)} (its files are in this directory)",
    ]


def _image_data(info: dict[str, Any], model_config: Any) -> list[str]:
    size = getattr(model_config, "image_size", "?")
    classes = info.get("class_map") or {}
    return [
        f"- corpus: `{info.get('corpus', '?')}` (kind `{info.get('kind', '?')}`)",
        f"- images per split: {json.dumps(info.get('splits', {}))}",
        f"- input: {size}x{size} RGB, resized and centre-cropped as `preprocessor_config.json` says (the run's evaluation)",
        f"- classes ({len(classes)}): {json.dumps(classes)}",
    ]


def _eval_scope(state: dict[str, Any]) -> str:
    """Which part of the validation split the figures cover: a partial one depends on the number of ranks."""
    batches = state.get("eval_batches")
    if batches is None:
        return "On the validation split (the run did not record how much of it)."
    if batches == 0:
        return "On the whole validation split, each sample once."
    return (f"On the first {batches} batches per rank of the validation split, on {state.get('world_size')} rank(s) "
            f"(`train.eval_batches={batches}`; a part of the split, so another number of ranks gives other figures; "
            f"`train.eval_batches=0` evaluates all of it).")


def model_card(state: dict[str, Any], ckpt: Path, hf: Any, family: str, release_path: str) -> str:
    """The release's ``README.md``: data, training, final evaluation and how to load it (``release_path``)."""
    spec = get_family(family)
    info = state.get("data_info", {})
    kind = corpus_kind(info.get("kind") or spec.corpus_kind)
    data_lines, seen = (_text_data if kind.tokenized else _image_data), kind.seen
    ev = state.get("eval") or {}
    metrics = "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(ev.items()) if isinstance(v, (int, float))) or "| (none) | |"
    build = state.get("model_build", {})
    data = "\n".join(data_lines(info, hf.config))
    return f"""---
library_name: transformers
tags: [pretrain, {state.get("task", "")}]
---
# {build.get("name", "model")} ({type(hf).__name__})

Pretrained with the `pretrain` pipeline (objective `{state.get("task")}`), exported from `{ckpt}`.

## Data
{data}

## Training
- optimizer steps: {state.get("step")}
- {seen} seen: {state.get("tokens")}
- samples seen: {state.get("samples")}
- world size: {state.get("world_size")}, engine: {state.get("engine")}, ZeRO stage: {state.get("zero_stage")}, precision: {state.get("precision")}
- model overrides: `{json.dumps(build.get("overrides", {}))}`
- loss: first step {state.get("start_loss")}, last step {state.get("last_loss")}

## Final evaluation
{_eval_scope(state)}

| metric | value |
|---|---|
{metrics}

## Use
{spec.card_usage(release_path) if spec.card_usage else ""}"""

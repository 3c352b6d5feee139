"""The model card (``README.md``) of a pretraining release, per model family.

Each family says what its data was (text: sequence length, tokens and tokenizer; images: image size
and classes), what "seen" counts (tokens or images) and how to load the release in ``transformers``
with the class and preprocessing that fit it: a snippet that runs as written from where
``pretrain export`` was run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["model_card", "CARD_USES"]

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


def _bert_use(path: str) -> str:
    return f"""```python
from transformers import pipeline

fill = pipeline("fill-mask", model="{path}")
print(fill("the [MASK] statement"))
```

This is a `BertForPreTraining` checkpoint: the encoder, the MLM head, and the pooler + next-sentence
head that `AutoModelForSequenceClassification` starts its classifier from (as Google's BERT
checkpoints are). `AutoModelForMaskedLM` and `pipeline("fill-mask")` load it as `BertForMaskedLM`,
which has no pooler or NSP head, so transformers lists those 4 tensors (`bert.pooler.dense.*`,
`cls.seq_relationship.*`) as UNEXPECTED: expected, nothing the MLM needs is missing. Load it as
`BertForPreTraining` for both heads, or fine-tune it with `pretrain finetune` or
`AutoModelForSequenceClassification` / `AutoModelForQuestionAnswering`.
"""


def _gpt_use(path: str) -> str:
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{path}")
model = AutoModelForCausalLM.from_pretrained("{path}")
inputs = tokenizer("the", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))
```
"""


def _vit_use(path: str) -> str:
    return f"""```python
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageClassification

processor = AutoImageProcessor.from_pretrained("{path}")
model = AutoModelForImageClassification.from_pretrained("{path}")
inputs = processor(Image.open("image.png"), return_tensors="pt")
print(model.config.id2label[int(model(**inputs).logits.argmax(-1))])
```

`pipeline("image-classification", model="{path}")` does the same; the processor resizes and crops
exactly as the run's evaluation did, so it scores what the run reported.
"""


#: family -> (data lines, what "seen" counts, usage section)
CARD_USES: dict[str, tuple[Callable[[dict[str, Any], Any], list[str]], str, Callable[[str], str]]] = {
    "bert": (_text_data, "tokens", _bert_use),
    "gpt": (_text_data, "tokens", _gpt_use),
    "vit": (_image_data, "images", _vit_use),
}


def model_card(state: dict[str, Any], ckpt: Path, hf: Any, family: str, release_path: str) -> str:
    """The release's ``README.md``: data, training, final evaluation and how to load it (``release_path``)."""
    data_lines, seen, use = CARD_USES[family]
    info = state.get("data_info", {})
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
| metric | value |
|---|---|
{metrics}

## Use
{use(release_path)}"""

"""What a fine-tuned model (BERT, or GPT for classification) is fed, decided once for training, evaluation and the release.

Training pads on the right with one pad id and always feeds segment ids (``data.encode_examples``,
``collate_classification``). An outside release's tokenizer may have no pad token, pad on the left or
leave ``token_type_ids`` out of its ``model_input_names``; a transformers user of our release would
then feed the model something it never saw (or nothing at all: no padding possible). So the release
gets a tokenizer that says what training did (``release_tokenizer``), and ``metrics.json`` is scored
with that tokenizer's defaults, as a user calls it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pipelines.finetune.data import FinetuneError

__all__ = ["pad_token_id", "check_max_seq_len", "check_segments", "release_tokenizer", "write_task_release"]

#: BERT's inputs in transformers' order; training feeds all three.
BERT_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def pad_token_id(tokenizer: Any, model_config: Any, release: Path, fallbacks: tuple[str, ...] = ()) -> int:
    """The tokenizer's pad id, else the model config's ``pad_token_id``, else the first of the tokenizer's
    ``fallbacks`` it has (GPT: ``eos_token_id``, transformers' common practice for GPT-2, which ships no pad
    token); the release's tokenizer then names that token as its pad token. With none, refused before
    training: no id is right by default."""
    pad = tokenizer.pad_token_id
    if pad is not None:
        return int(pad)
    pad = getattr(model_config, "pad_token_id", None)
    for name in fallbacks if pad is None else ():
        pad = getattr(tokenizer, name, None)
        if pad is not None:
            break
    if pad is None and fallbacks:  # a GPT: the pad id also says which token is classified (the last that is not it)
        raise FinetuneError(
            f"{release}: the tokenizer has no pad token and no {' or '.join(fallbacks)}, and config.json no "
            f"pad_token_id, so batches cannot be padded; the classifier reads each text's last token that is not the "
            f"pad token, so the pad must be a token no text ends with, such as an end-of-text token (any other id "
            f"moves texts ending in it to an earlier token). Give the tokenizer one it has (tokenizer.eos_token = "
            f"'<|endoftext|>'; tokenizer.save_pretrained('{release}')) or set pad_token_id in {release}/config.json.")
    if pad is None:
        raise FinetuneError(
            f"{release}: the tokenizer has no pad token and config.json no pad_token_id, so batches cannot be "
            f"padded (in training, or by users of the fine-tuned release). Give the tokenizer one — e.g. "
            f"tokenizer.pad_token = tokenizer.unk_token (any id works: padded positions are masked), then "
            f"tokenizer.save_pretrained('{release}') — or set pad_token_id in {release}/config.json.")
    if not 0 <= pad < min(len(tokenizer), model_config.vocab_size):
        raise FinetuneError(
            f"{release}/config.json: pad_token_id={pad} is not a token of the tokenizer ({len(tokenizer)} tokens) and "
            f"the model ({model_config.vocab_size} rows), and the tokenizer has no pad token. Give the tokenizer a "
            f"pad token (tokenizer.pad_token = ...; tokenizer.save_pretrained('{release}')) or fix pad_token_id.")
    return int(pad)


def check_max_seq_len(max_seq_len: int, model_config: Any, release: Path) -> None:
    """Refuse ``data.max_seq_len`` beyond the position table before training (else an IndexError at step 1)."""
    max_pos = getattr(model_config, "max_position_embeddings", max_seq_len)
    if max_seq_len > max_pos:
        raise FinetuneError(f"data.max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={max_pos} "
                            f"({release}/config.json); lower data.max_seq_len to {max_pos} or less.")


def check_segments(pair: bool, model_config: Any, release: Path) -> None:
    """A text pair's second segment has token type 1: a model with one token type (``type_vocab_size=1``,
    as some BERT-architecture releases ship) has no row for it, an IndexError at step 1 otherwise."""
    types = getattr(model_config, "type_vocab_size", 2)
    if pair and types < 2:
        raise FinetuneError(f"{release}/config.json has type_vocab_size={types}: the model cannot tell a text pair's "
                            f"two segments apart (the second has token type 1). Fine-tune it on single texts (no "
                            f"data.text_pair_column; QA always pairs question and context), or use a checkpoint "
                            f"with type_vocab_size >= 2.")


def release_tokenizer(base: Path, pad_id: int, staging: Path, max_length: int,
                      input_names: tuple[str, ...] = BERT_INPUTS) -> tuple[Path, list[str]]:
    """The tokenizer directory to ship with the release, and what was changed in it.

    ``base`` itself when its tokenizer already does what training did (our own releases fine-tuned at their
    corpus's sequence length: copied byte for byte); else a copy saved in ``staging`` with pad token ``pad_id``, ``padding_side="right"`` (BERT's
    positions are absolute: left padding moves every token of a short text to other positions than it
    was trained at, and scores worse) and ``token_type_ids`` in ``model_input_names`` (trained with
    segment ids: without them, a pair's second text reads as the first) and ``model_max_length`` equal to
    ``max_length``, training's ``data.max_seq_len`` (transformers' unset default is 10**30, so ``truncation=True``
    kept inputs longer than the position table and the model crashed on them; a GPT-2 tokenizer's 1024, or
    the position table's size, truncated longer than training did, so ``pipeline(..., truncation=True)`` scored
    texts over ``max_seq_len`` tokens on more of them than ``metrics.json`` did). ``input_names`` are the model's inputs among BERT's
    three: a GPT takes no ``token_type_ids`` (``GPT2Model`` would add their token embeddings to the text's,
    which training never did), so its release's tokenizer returns ``input_ids`` and ``attention_mask`` only. Pinning the tokenizer, rather
    than documenting call arguments, gives every transformers user (``pipeline`` included) the trained
    behaviour by default.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base), trust_remote_code=False)
    fixes: dict[str, Any] = {}
    if tok.pad_token_id != pad_id:
        fixes["pad_token"] = tok.convert_ids_to_tokens(pad_id)
    if tok.padding_side != "right":
        fixes["padding_side"] = "right"
    if tok.model_max_length != max_length:
        fixes["model_max_length"] = max_length
    if {n for n in tok.model_input_names if n in BERT_INPUTS} != set(input_names):
        fixes["model_input_names"] = [*input_names, *(n for n in tok.model_input_names if n not in BERT_INPUTS)]
    if not fixes:
        return base, []
    AutoTokenizer.from_pretrained(str(base), trust_remote_code=False, **fixes).save_pretrained(str(staging))
    return staging, [f"{k}={v!r}" for k, v in fixes.items()]


def write_task_release(hf: Any, out: Path, base: Path, pad_id: int, card: str, max_length: int,
                       input_names: tuple[str, ...] = BERT_INPUTS) -> Path:
    """``write_release`` of a fine-tuned model with ``release_tokenizer``'s tokenizer (``max_length``: training's
    ``data.max_seq_len``); a change is printed and carded."""
    from pipelines.engine.export import write_release

    with tempfile.TemporaryDirectory(prefix=".release-tokenizer-", dir=out.parent) as staging:
        tokenizer_dir, changed = release_tokenizer(base, pad_id, Path(staging), max_length, input_names)
        if changed:  # the base's tokenizer would feed transformers users other inputs than training did
            print(f"The release's tokenizer says what training fed the model: {', '.join(changed)}.", flush=True)
            card += f"\nIts tokenizer is `{base}`'s with {', '.join(f'`{c}`' for c in changed)}, as in training.\n"
        return write_release(hf, out, tokenizer_dir=tokenizer_dir, card=card)

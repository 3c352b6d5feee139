"""Train (WordPiece for BERT, byte-level BPE for GPT) or reuse a `tokenizers` tokenizer.

Saved as Hugging Face files inside the corpus (`tokenizer/tokenizer.json` plus the
`PreTrainedTokenizerFast` config files) so `transformers.AutoTokenizer.from_pretrained(dir)`
loads it; the manifest records the sha256 of `tokenizer.json`. Training input is a sample taken
in a fixed (hash) order, so the same corpus and config give a byte-identical tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from core.files import atomic_write_text
from data_prep.config import TokenizerConfig
from data_prep.errors import PrepError

__all__ = ["train_tokenizer", "save_tokenizer", "load_tokenizer_dir", "tokenizer_info", "special_ids", "missing_separator_error",
           "BERT_SPECIALS", "GPT_EOS", "SPECIAL_TOKEN_NAMES"]

# BERT's special tokens (Devlin et al. 2019, Sec. 3); [PAD] first so the padding id is 0.
BERT_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
GPT_EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], cfg: TokenizerConfig):
    """Train a tokenizer of `cfg.type` on `texts` (in the given order)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if cfg.type == "wordpiece":
        normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=cfg.lowercase)
        pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        vocab = _train_wordpiece_vocab(texts, cfg, normalizer, pre_tokenizer)
        tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.WordPiece(prefix="##")
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=[GPT_EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# `tokenizers`' WordPieceTrainer numbers its "##" alphabet in hash-map order, so two runs on the
# same text give different ids (and, at ties, different vocabularies). We train the equivalent
# BPE instead (deterministic when there is no subword prefix), marking every non-initial
# character by moving it to a private-use plane; unmarking yields the same "##" vocabulary the
# WordPiece trainer learns (it is BPE with a continuation prefix), in a reproducible order.
_MARK = 0xF0000


def _mark(word: str) -> str | None:
    if any(ord(c) > 0xFFFF for c in word):
        return None  # astral-plane characters are left to [UNK]
    return word[0] + "".join(chr(_MARK + ord(c)) for c in word[1:])


def _unmark(token: str) -> str:
    if ord(token[0]) >= _MARK:
        return "##" + "".join(chr(ord(c) - _MARK) for c in token)
    return token[0] + "".join(chr(ord(c) - _MARK) for c in token[1:])


def _train_wordpiece_vocab(texts: list[str], cfg: TokenizerConfig, normalizer, pre_tokenizer) -> dict[str, int]:
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    marked = {m: n for w, n in counts.items() if (m := _mark(w))}

    def words():
        for word in sorted(marked):
            yield " ".join([word] * marked[word])

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = list(BERT_SPECIALS.values())
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=specials, show_progress=False)
    bpe.train_from_iterator(words(), trainer=trainer, length=len(marked))
    ordered = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    return {(tok if tok in specials else _unmark(tok)): i for i, (tok, _) in enumerate(ordered)}


def _special_map(tok, type_: str) -> dict[str, str]:
    if type_ == "wordpiece":
        return dict(BERT_SPECIALS)
    return {"bos_token": GPT_EOS, "eos_token": GPT_EOS, "unk_token": GPT_EOS}


def save_tokenizer(tok, out_dir: str | os.PathLike, type_: str, model_max_length: int, lowercase: bool) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json (atomically)."""
    out = Path(out_dir)
    specials = _special_map(tok, type_)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    if type_ == "wordpiece":
        config["do_lower_case"] = lowercase
        config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    atomic_write_text(out / "tokenizer.json", tok.to_str(pretty=True))
    atomic_write_text(out / "tokenizer_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    atomic_write_text(out / "special_tokens_map.json", json.dumps(specials, indent=2, sort_keys=True) + "\n")


def load_tokenizer_dir(path: str | os.PathLike):
    """(tokenizer, type) of a directory holding tokenizer.json (or the file itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise PrepError(
            f"Tokenizer {path} has no tokenizer.json. Point `tokenizer.path` at a directory saved by "
            f"`tokenizers`/`transformers` (save_pretrained), or leave it empty to train one."
        )
    tok = read_tokenizer_file(file, "Point `tokenizer.path` at an intact tokenizer (re-copy or re-save it), or leave "
                                    "it empty to train one.")
    return tok, ("wordpiece" if type(tok.model).__name__ == "WordPiece" else "bpe")


def read_tokenizer_file(file: Path, fix: str):
    """``tokenizers.Tokenizer.from_file``, with a damaged file (cut short, not JSON, not UTF-8) as one PrepError
    naming it: the library raises a bare ``Exception("EOF while parsing ...")`` that would reach the user
    as a traceback."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust binding raises a plain Exception for every parse error
        raise PrepError(f"{file} is not a readable tokenizer.json ({exc}): it is damaged or not from "
                        f"`tokenizers`/`transformers`. {fix}") from None


def install_tokenizer(src: str, dest_dir: str | os.PathLike) -> None:
    """Copy a reused tokenizer's HF files into the corpus so the corpus is self-contained."""
    src_dir = Path(src) if Path(src).is_dir() else Path(src).parent
    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src_dir / name).is_file():
            tmp = Path(dest_dir) / f".{name}.tmp"
            shutil.copyfile(src_dir / name, tmp)
            os.replace(tmp, Path(dest_dir) / name)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_info(corpus_dir: str | os.PathLike, type_: str, tok=None) -> dict[str, Any]:
    """The manifest's `tokenizer` entry: relative path, sha256, vocab size, type, special ids.

    `tok`: the tokenizer already loaded from (or saved as) the corpus's tokenizer.json, if any.
    """
    tdir = Path(corpus_dir) / "tokenizer"
    if tok is None:
        tok, _ = load_tokenizer_dir(tdir)
    return {
        "path": "tokenizer",
        "sha256": _sha256(tdir / "tokenizer.json"),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "type": type_,
        "special_tokens": special_ids(tdir, type_, tok),
    }


#: The special tokens a tokenizer's HF config files name (those ``transformers`` turns into ``<name>_id``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


def _special_names(file: Path) -> dict[str, str]:
    """``{"eos_token": "</s>", ...}`` named in ``file`` (special_tokens_map.json or tokenizer_config.json; a value
    is a string or a dict with "content"); {} when the file is absent."""
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PrepError(f"{file} is not valid JSON ({exc}). Re-save the tokenizer (save_pretrained) or remove "
                        f"that file to use the default special tokens.") from None
    names: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = raw.get(name) if isinstance(raw, dict) else None
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token:
            names[name] = token
    return names


def special_ids(tdir: Path, type_: str, tok) -> dict[str, int]:
    """``{"cls_token": id, ...}`` of the tokenizer in ``tdir``: the special tokens its tokenizer_config.json names,
    overridden by its special_tokens_map.json (as ``transformers.AutoTokenizer`` reads them, so the manifest and a
    release's ``eos_token_id``/``pad_token_id`` agree; transformers 5 writes only tokenizer_config.json), else the
    type's defaults. Also what ``prepare`` checks a reused tokenizer against before copying it into the corpus."""
    names = {**_special_names(tdir / "tokenizer_config.json"), **_special_names(tdir / "special_tokens_map.json")}
    if not names:
        names = dict(BERT_SPECIALS) if type_ == "wordpiece" else {"eos_token": GPT_EOS}
    specials: dict[str, int] = {}
    for name, token in sorted(names.items()):
        tid = tok.token_to_id(token)
        if tid is not None:
            specials[name] = tid
    return specials


def missing_separator_error(tdir: str | os.PathLike) -> PrepError:
    """The error of a packed (GPT) corpus whose tokenizer names no token to end a document with."""
    return PrepError(
        f"The tokenizer at {tdir} names no end-of-text token (eos_token, or sep_token) that is in its vocabulary, "
        f"so packed_lm cannot separate documents (it would join them with token 0, often the pad token, and the "
        f"model would never learn to stop). Set eos_token (e.g. \"</s>\" or \"<|endoftext|>\", a token of "
        f"tokenizer.json) in {Path(tdir) / 'tokenizer_config.json'} or special_tokens_map.json (or re-save it with "
        f"save_pretrained after setting tokenizer.eos_token), or leave tokenizer.path empty to train one."
    )

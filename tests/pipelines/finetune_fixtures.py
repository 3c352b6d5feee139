"""Small real inputs for fine-tuning tests: a WordPiece tokenizer trained on Python's own docs and a
transformers-created BERT checkpoint directory (what a user downloads), made locally."""

from __future__ import annotations

from pathlib import Path


def pydoc_paragraphs(limit: int = 400) -> list[str]:
    from pydoc_data.topics import topics

    paras = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 60]
    return paras[:limit]


def save_wordpiece_tokenizer(out: Path, vocab_size: int = 1000) -> Path:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(pydoc_paragraphs(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(str(out))
    return out


def save_hf_bert_checkpoint(out: Path, *, vocab_size: int = 1000, seed: int = 0) -> Path:
    """A tiny `BertForPreTraining` saved by transformers itself (safetensors + config + tokenizer)."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    save_wordpiece_tokenizer(out, vocab_size)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    BertForPreTraining(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


def write_topic_task(out: Path, per_class: int = 100) -> tuple[Path, Path]:
    """Classify which of three pydoc topics a paragraph (sentence window) comes from."""
    from pydoc_data.topics import topics

    rows = {"train": [], "validation": []}
    for label in ("debugger", "string-methods", "formatstrings"):
        sentences = [s.strip() for s in topics[label].replace("\n", " ").split(". ") if len(s.strip()) > 30]
        for i, s in enumerate(sentences[: per_class]):
            rows["validation" if i % 5 == 0 else "train"].append((" ".join(s.split()), label))
    paths = []
    for split, items in rows.items():
        path = out / f"{split}.tsv"
        path.write_text("text\tlabel\n" + "".join(f"{t}\t{lab}\n" for t, lab in items))
        paths.append(path)
    return paths[0], paths[1]


def save_outside_bert(out: Path, *, model_class: str = "BertForMaskedLM", tokenizer_kwargs: dict | None = None,
                      no_pad_token: bool = False, vocab_size: int = 1000, **config) -> Path:
    """A tiny BERT as other people publish them, saved by transformers: ``config`` overrides the
    `BertConfig`, ``tokenizer_kwargs`` are saved into the tokenizer's config (``padding_side``,
    ``model_input_names``: BERT's three by default) and ``no_pad_token`` drops its pad token (the [PAD]
    entry stays in the vocabulary)."""
    import torch
    import transformers

    save_wordpiece_tokenizer(out, vocab_size)
    bert_inputs = {"model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}  # as BertTokenizerFast's
    tok = transformers.AutoTokenizer.from_pretrained(str(out), **{**bert_inputs, **(tokenizer_kwargs or {})})
    if no_pad_token:
        tok.pad_token = None
    tok.save_pretrained(str(out))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(**{**dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=64, max_position_embeddings=128), **config})
    getattr(transformers, model_class)(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


def write_pair_task(task: tuple[Path, Path], out: Path) -> tuple[Path, Path]:
    """``write_topic_task``'s sentences cut in two halves, a text pair each (segment ids tell them apart)."""
    paths = []
    for path in task:
        rows = [line.split("\t") for line in path.read_text().splitlines()[1:]]
        halves = [(t.split()[: len(t.split()) // 2], t.split()[len(t.split()) // 2:], y) for t, y in rows]
        target = out / f"pair_{path.name}"
        target.write_text("text\ttext2\tlabel\n" + "".join(f"{' '.join(a)}\t{' '.join(b)}\t{y}\n" for a, b, y in halves))
        paths.append(target)
    return paths[0], paths[1]


def write_regression_task(task: tuple[Path, Path], out: Path) -> tuple[Path, Path]:
    """``write_topic_task``'s sentences with a numeric target: their length in words / 20."""
    paths = []
    for path in task:
        texts = [line.split("\t")[0] for line in path.read_text().splitlines()[1:]]
        target = out / f"reg_{path.name}"
        target.write_text("text\tlabel\n" + "".join(f"{t}\t{len(t.split()) / 20}\n" for t in texts))
        paths.append(target)
    return paths[0], paths[1]


def save_gpt2_tokenizer(out: Path, vocab_size: int = 500) -> Path:
    """A GPT-2-style byte-level BPE (``<|endoftext|>`` as bos/eos/unk, no pad token) trained on Python's docs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(pydoc_paragraphs(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(str(out))
    return out


def save_hf_gpt2(out: Path, *, model_class: str = "GPT2LMHeadModel", vocab_size: int = 500, **config) -> Path:
    """A tiny GPT-2 saved by transformers itself, with ``save_gpt2_tokenizer``'s tokenizer (no pad token)."""
    import torch
    import transformers

    save_gpt2_tokenizer(out, vocab_size)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**{**dict(vocab_size=vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                                            bos_token_id=0, eos_token_id=0), **config})
    getattr(transformers, model_class)(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


def save_our_gpt_checkpoint(root: Path, *, vocab_size: int = 500, pad_vocab_multiple: int = 1) -> Path:
    """A run checkpoint of our ``gpt-tiny`` (random weights) with our own byte-level BPE (``pretrain prepare``'s),
    as ``pretrain train configs/train/gpt_*.yaml`` leaves it; ``pretrain export`` makes it a release."""
    from data_prep.config import TokenizerConfig
    from data_prep.tokenizer import save_tokenizer, train_tokenizer

    tok = train_tokenizer(pydoc_paragraphs(), TokenizerConfig(type="bpe", vocab_size=vocab_size, min_frequency=2))
    ckpt = root / "step-00000001"
    save_tokenizer(tok, ckpt / "tokenizer", "bpe", model_max_length=128, lowercase=False)
    overrides = {"vocab_size": tok.get_vocab_size(), "max_position_embeddings": 128, "num_layers": 2,
                 "hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
    if pad_vocab_multiple != 1:
        overrides["pad_vocab_multiple"] = pad_vocab_multiple
    return write_one_step_checkpoint(ckpt, "gpt-tiny", "causal_lm", overrides, zero_stage=0)


def write_one_step_checkpoint(ckpt: Path, name: str, task: str, overrides: dict, **state) -> Path:
    """A DDP-engine checkpoint (what ``pretrain export`` reads) of ``models.create(name, **overrides)`` at seed 0,
    beside the tokenizer already in ``ckpt/tokenizer``; ``state``: more trainer-state fields."""
    import json

    import torch

    import models

    torch.manual_seed(0)
    (ckpt / "engine").mkdir(parents=True)
    torch.save(models.create(name, **overrides).state_dict(), ckpt / "engine" / "model.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({
        "step": 1, "task": task, "engine": "ddp", **state, "model_build": {"name": name, "overrides": overrides}}))
    return ckpt

"""A reused tokenizer saved by transformers 5 (tokenizer.json + tokenizer_config.json, no special_tokens_map.json):
prepare must read its special tokens from tokenizer_config.json, as export does, and pack documents with its
``</s>``, never with token 0 (``<pad>``); a tokenizer with no end-of-text token at all is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.corpus import read_shard
from data_prep.config import PrepConfig, SourceConfig, TokenizerConfig
from data_prep.errors import PrepError
from data_prep.job import run_prepare

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def _documents(n: int = 40) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 40)))) + "." for _ in range(n)]


def _hf5_tokenizer(tdir: Path, **specials: str) -> Path:
    """A tiny byte-level BPE (<pad>=0, <s>=1, </s>=2) saved as transformers 5 does, without special_tokens_map.json."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_documents(), trainer=trainer)
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(str(tdir))
    (tdir / "special_tokens_map.json").unlink(missing_ok=True)
    return tdir


def _packed_cfg(tmp_path: Path, tokenizer_dir: Path) -> PrepConfig:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i, doc in enumerate(_documents()):
        (raw / f"doc-{i:03d}.txt").write_text(doc, encoding="utf-8")
    return PrepConfig(
        kind="packed_lm", output=str(tmp_path / "gpt"), seq_len=32, progress=False, validation_fraction=0.1,
        num_workers=1, sources=[SourceConfig(type="text", paths=[str(raw / "*.txt")], text_mode="file")],
        tokenizer=TokenizerConfig(type="bpe", path=str(tokenizer_dir)),
    )


def test_transformers5_tokenizer_packs_documents_with_its_eos_not_pad(ray_cluster, tmp_path):
    tdir = _hf5_tokenizer(tmp_path / "tok", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    assert not (tdir / "special_tokens_map.json").exists()
    run_prepare(_packed_cfg(tmp_path, tdir))
    manifest = json.loads((tmp_path / "gpt" / "manifest.json").read_text())
    specials = manifest["tokenizer"]["special_tokens"]
    assert specials["eos_token"] == 2 and specials["pad_token"] == 0 and specials["bos_token"] == 1
    from pipelines.engine.export import tokenizer_special_ids

    release_ids = tokenizer_special_ids(tmp_path / "gpt" / "tokenizer")  # what export writes into config.json
    assert release_ids["eos_token_id"] == specials["eos_token"] and release_ids["pad_token_id"] == specials["pad_token"]
    eos_seen = windows = 0
    for info in manifest["splits"].values():
        for shard in info["shards"]:
            for _, members in read_shard(tmp_path / "gpt" / shard["name"]):
                ids = np.frombuffer(members["input_ids.u16"], dtype="<u2")
                assert len(ids) == 33
                assert not (ids == 0).any(), "a packed window holds <pad> (id 0)"
                eos_seen += int((ids == 2).sum())
                windows += 1
    assert windows > 0 and eos_seen > 0  # documents are separated by </s>


def test_tokenizer_without_eos_is_refused_for_packed_lm(tmp_path):
    tdir = _hf5_tokenizer(tmp_path / "tok", bos_token="<s>", pad_token="<pad>")
    cfg = _packed_cfg(tmp_path, tdir)
    with pytest.raises(PrepError, match="names no end-of-text token") as err:
        run_prepare(cfg)
    assert str(tdir) in str(err.value) and "eos_token" in str(err.value) and "tokenizer_config.json" in str(err.value)
    assert not (tmp_path / "gpt").exists()  # refused before anything is written

"""Unit tests of the pure pieces: cleaning, sentence splitting, NSP pairs, packing, shards, tokenizer."""

from __future__ import annotations

import json
import random
import tarfile
import unicodedata

import numpy as np
import pytest

from core.config import ConfigError
from core.corpus import read_shard
from core.files import sha256_file
from data_prep.bert_pairs import create_pairs, split_sentences
from data_prep.clean import Stats, band_keys, clean_text, lsh_params, minhash_signature
from data_prep.config import CleanConfig, PrepConfig, SourceConfig, TokenizerConfig, load_prep_config
from data_prep.packing import pack_windows
from data_prep.shards import load_record, save_record, write_shard


def test_clean_rules_are_counted():
    stats = Stats()
    text = clean_text("Cafe\u0301 \x00bar\u200b\t\t baz\r\n\n\n\nsecond   paragraph here", CleanConfig(), stats)
    assert text == "Café bar baz\n\nsecond paragraph here"
    assert stats.counts["modified.nfc"] == 1
    assert stats.counts["chars_removed.control"] == 2
    assert clean_text("short", CleanConfig(min_chars=20), stats) is None
    assert clean_text("x" * 50, CleanConfig(max_chars=10), stats) is None
    assert stats.counts["removed.too_short"] == 1 and stats.counts["removed.too_long"] == 1
    merged = Stats.from_dict(stats.to_dict()).merge(stats)
    assert merged.counts["removed.too_short"] == 2


def test_the_first_bad_record_of_a_file_survives_merging_in_any_order():
    """Each task reports the bad records of its range; the error names the earliest of the file's."""
    late, early = Stats(), Stats()
    late.bad("a.jsonl", "bad_json", at=("byte", 900))
    early.bad("a.jsonl", "missing_field", at=("byte", 40))
    early.bad("b.parquet", "missing_field", at=("row", 7))
    early.bad("c.txt", "empty_file")
    for parts in ((late, early), (early, late)):
        merged = Stats()
        for part in parts:
            merged.merge(Stats.from_dict(json.loads(json.dumps(part.to_dict()))))  # as tasks return them
        assert merged.first_bad == {"a.jsonl": ("byte", 40), "b.parquet": ("row", 7)}
        assert merged.bad_by_file["a.jsonl"] == {"bad_json": 1, "missing_field": 1}


def test_minhash_finds_near_duplicates():
    base = " ".join(f"word{i}" for i in range(200))
    near = base.replace("word100", "changed")
    other = " ".join(f"other{i}" for i in range(200))
    bands, rows = lsh_params(64, 0.8)
    keys = [set(band_keys(minhash_signature(t, 64, 5), bands, rows)) for t in (base, near, other)]
    assert keys[0] & keys[1]
    assert not keys[0] & keys[2]


def test_split_sentences():
    text = "Hello world. This is e.g. a test! Another one?\n\nNew paragraph\n- item one\n- item two"
    assert split_sentences(text) == ["Hello world.", "This is e.g. a test!", "Another one?", "New paragraph", "- item one", "- item two"]


def _docs(rng: random.Random, n_docs: int) -> list[list[np.ndarray]]:
    return [[np.arange(rng.randint(3, 30)) + 10 for _ in range(rng.randint(1, 12))] for _ in range(n_docs)]


def test_bert_pairs_follow_the_recipe():
    rng = random.Random(0)
    docs = _docs(rng, 300)
    pairs = [p for k in range(len(docs)) for p in create_pairs(docs, k, max_seq_len=64, cls_id=2, sep_id=3, rng=rng)]
    labels = [label for *_, label in pairs]
    assert abs(np.mean(labels) - 0.5) < 0.05
    for ids, len_a, len_b, _ in pairs:
        assert len(ids) == len_a + len_b + 3 <= 64
        assert ids[0] == 2 and ids[1 + len_a] == 3 and ids[-1] == 3
        assert len_a >= 1 and len_b >= 1


def test_bert_pairs_skip_empty_random_documents():
    docs = [[np.arange(5) + 10, np.arange(7) + 10], [], [np.array([], dtype=np.int64)], [np.arange(9) + 10]]
    rng = random.Random(1)
    pairs = [pair for _ in range(50) for k in (0, 3)
             for pair in create_pairs(docs, k, max_seq_len=16, cls_id=2, sep_id=3, rng=rng, random_next_prob=1.0)]
    assert sum(label for *_, label in pairs) >= 100  # random next documents were drawn, never an empty one
    for ids, len_a, len_b, _label in pairs:
        assert len_a >= 1 and len_b >= 1 and len(ids) == len_a + len_b + 3
        assert all(10 <= t < 19 for t in ids[1: 1 + len_a]) and all(10 <= t < 19 for t in ids[2 + len_a: -1])


def test_packing_keeps_everything_but_the_tail():
    docs = [np.arange(n, dtype=np.uint16) + 5 for n in (50, 70, 300, 20)]
    windows, counts = pack_windows(docs, eos_id=0, seq_len=32)
    out = list(windows)
    assert all(len(w) == 33 for _, w in out)
    stream = np.concatenate([np.append(d, 0) for d in docs])
    assert np.array_equal(np.concatenate([out[0][1]] + [w[1:] for _, w in out[1:]]), stream[: counts["kept"]])
    assert counts["total"] == len(stream) and counts["total"] - counts["kept"] < 33


def test_shards_are_reproducible_atomic_and_checked(tmp_path):
    samples = [(f"k{i:04d}", {"input_ids.u16": np.arange(i + 1, dtype="<u2").tobytes(), "meta.json": b"{}"}) for i in range(20)]
    a = write_shard(tmp_path / "a.tar", samples)
    b = write_shard(tmp_path / "b.tar", samples)
    assert {**a, "index": a["index"]["sha256"]} == {**b, "index": b["index"]["sha256"]}  # same bytes, same index
    assert a["samples"] == 20 and a["sha256"] == sha256_file(tmp_path / "a.tar") and a["index"]["records"] == 20
    assert [k for k, _ in read_shard(tmp_path / "a.tar")] == [k for k, _ in samples]
    assert len(tarfile.open(tmp_path / "a.tar").getnames()) == 40

    def broken():
        yield samples[0]
        raise RuntimeError("crash mid-shard")

    with pytest.raises(RuntimeError):
        write_shard(tmp_path / "c.tar", broken())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.idx.npy", "a.tar", "b.idx.npy", "b.tar"]  # nothing half-written
    save_record(tmp_path, "a.tar", {"fingerprint": "f", **a})
    assert load_record(tmp_path, "a.tar", "f") is not None
    assert load_record(tmp_path, "a.tar", "other") is None
    with open(tmp_path / "a.tar", "r+b") as fh:  # corrupt one byte: the record no longer matches
        fh.seek(600)
        fh.write(b"X")
    assert load_record(tmp_path, "a.tar", "f") is None


def test_wordpiece_training_is_deterministic(tmp_path):
    from pydoc_data.topics import topics

    from data_prep.tokenizer import save_tokenizer, tokenizer_info, train_tokenizer

    texts = [topics[k] for k in sorted(topics)][:40]
    cfg = TokenizerConfig(vocab_size=2000)
    first, second = train_tokenizer(texts, cfg), train_tokenizer(texts, cfg)
    assert first.to_str() == second.to_str()
    vocab = first.get_vocab()
    assert [vocab[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    assert any(t.startswith("##") for t in vocab)
    enc = first.encode("Lists are Mutable.", "Second segment")
    assert enc.tokens[0] == "[CLS]" and enc.type_ids[-1] == 1 and "lists" in enc.tokens
    save_tokenizer(first, tmp_path / "tokenizer", "wordpiece", model_max_length=128, lowercase=True)
    info = tokenizer_info(tmp_path, "wordpiece")
    assert info["special_tokens"]["mask_token"] == 4 and info["vocab_size"] == first.get_vocab_size()
    assert json.loads((tmp_path / "tokenizer" / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_bpe_tokenizer_has_endoftext():
    from data_prep.tokenizer import train_tokenizer

    tok = train_tokenizer(["hello world " * 50, "more text here"] * 5, TokenizerConfig(type="bpe", vocab_size=300))
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.decode(tok.encode("hello world").ids) == "hello world"


def test_config_is_strict(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("kind: bert_pairs\noutput: out\nsources: [{type: text, paths: [a.txt]}]\n")
    cfg = load_prep_config(str(cfg_file), ["seq_len=256", "tokenizer.vocab_size=1000"])
    assert cfg.seq_len == 256 and cfg.tokenizer.vocab_size == 1000 and cfg.sources[0].text_mode == "paragraphs"
    with pytest.raises(ConfigError, match="seq_lenn"):
        load_prep_config(str(cfg_file), ["seq_lenn=3"])
    with pytest.raises(ConfigError, match="image_folder"):
        PrepConfig(kind="images", output="o", sources=[SourceConfig(type="text", paths=["x"])])


def test_shard_bytes_equal_tarfile(tmp_path):
    """The hand-built tar headers are exactly what `tarfile` (USTAR, fixed metadata) writes."""
    import io
    import os

    rng = random.Random(0)
    samples = [(f"{rng.getrandbits(64):016x}-{i:06d}", {"input_ids.u16": os.urandom(rng.choice([0, 1, 511, 512, 513, 3000])), "meta.json": b"{}"})
               for i in range(50)]
    samples.append(("k" * 90, {"x": b"long name"}))
    with open(tmp_path / "ref.tar", "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o644, 0, 0, "", ""
                tar.addfile(info, io.BytesIO(data))
    write_shard(tmp_path / "ours.tar", samples)
    assert (tmp_path / "ours.tar").read_bytes() == (tmp_path / "ref.tar").read_bytes()


def test_fast_cleaning_paths_match_the_regex_rules():
    """ASCII/plain-whitespace fast paths give what the general regex rules give."""
    from data_prep.clean import _BLANKS, _EDGE_SPACES, _SPACES, _normalize_whitespace, _strip_control

    rng = random.Random(1)
    alphabet = list("ab c\t\n\n  é\u200b\x00\x7f\x0b\u3000")
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert _normalize_whitespace(text) == _BLANKS.sub("\n\n", _EDGE_SPACES.sub("\n", _SPACES.sub(" ", text))).strip()
        stripped, n = _strip_control(text)
        expected = "".join(c for c in text if c in "\n\t" or not unicodedata.category(c).startswith("C") or unicodedata.category(c) == "Cn")
        assert stripped == expected and n == len(text) - len(expected)


def test_tasks_never_exceed_the_worker_count(ray_cluster):
    """`num_workers=1` means one task at a time even on a 2-CPU cluster; chunks cover every file."""
    import time

    import ray

    from data_prep.task_pool import chunk_entries, run_limited

    entries = [{"path": f"f{i}", "source": 0, "size": (i * 37) % 11 + 1} for i in range(23)]
    chunks = chunk_entries(entries, 4)
    assert sorted(e["path"] for c in chunks for e in c) == sorted(e["path"] for e in entries) and len(chunks) == 4

    @ray.remote
    def span(i):
        start = time.time()
        time.sleep(0.05)
        return start, time.time()

    spans = sorted(ray.get(run_limited(span, [(i,) for i in range(6)], workers=1)))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


def test_split_is_a_function_of_the_document():
    """A document's split comes from its hash alone (never its position, worker or shard count), so
    no document's text is in both splits; the validation share follows ``validation_fraction``."""
    from types import SimpleNamespace

    from data_prep.clean import doc_hash
    from data_prep.stages import route

    docs = [f"Paragraph {i} of the reference: every document is routed as a whole." for i in range(4000)]
    hashes = [doc_hash(d) for d in docs]
    few = SimpleNamespace(validation_fraction=0.1, buckets={"train": 3, "validation": 1})
    many = SimpleNamespace(validation_fraction=0.1, buckets={"train": 17, "validation": 5})
    split_of = [route(h, few).split("-")[0] for h in hashes]
    assert split_of == [route(h, many).split("-")[0] for h in hashes]  # shard counts do not move documents
    assert split_of == [route(doc_hash(d), few).split("-")[0] for d in docs]  # same text, same split
    assert abs(split_of.count("validation") / len(docs) - 0.1) < 0.02


def test_route_codes_route_every_document_as_route_does():
    """The map side routes a whole batch at once (`route_codes`); it must pick `route`'s shard for every hash."""
    from types import SimpleNamespace

    from data_prep.clean import doc_hash
    from data_prep.stages import route, route_codes

    hashes = [doc_hash(f"document {i}") for i in range(5000)] + ["0" * 64, "f" * 64, "1999999a" + "0" * 56]
    for fraction, buckets in ((0.1, {"train": 7, "validation": 3}), (0.0, {"train": 1}), (0.5, {"train": 64, "validation": 1})):
        ctx = SimpleNamespace(validation_fraction=fraction, buckets=buckets)
        codes, names = route_codes(hashes, ctx)
        assert [names[c] for c in codes] == [route(h, ctx) for h in hashes]
    assert route_codes([], ctx)[0].size == 0

"""A manifest and its shards are data: nothing in them runs, reads outside the corpus, or trains silently when damaged."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile

import corpus_fixtures as cf
import numpy as np
import pytest

from core.corpus import DataError, load_manifest, verify_shards
from pipelines.engine import objectives as tasks
from pipelines.engine.config import RunConfig
from pipelines.loading.loader import StreamingSource


def _src(m, **kw):
    return StreamingSource(m, "train", tasks.build_task(RunConfig(), m).collate, micro_batch_size=4, rank=0, world=1,
                           num_workers=0, shuffle_buffer=16, seed=3, **kw)


def _epoch(m, **kw):
    src = _src(m, **kw)
    return [k for b in src.batches(limit=src.batches_per_epoch) for k in b["keys"]]


def _edit(corpus, fn):
    path = corpus / "manifest.json"
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw))


@pytest.fixture()
def corpus(tmp_path):
    return cf.make_bert_corpus(tmp_path / "c", train_sizes=(25, 11, 7), val_sizes=(8,))


def test_a_pipe_url_in_a_manifest_is_refused_and_never_runs(tmp_path, corpus):
    marker = tmp_path / "pwned"

    def plant(raw):
        for s in raw["splits"]["train"]["shards"]:
            s["url"] = f"pipe:touch {marker}; cat {corpus / s['name']}"

    _edit(corpus, plant)
    with pytest.raises(DataError, match=r"manifest.json gives shard 'train-000000.tar' a url.*data.url_prefix"):
        m = load_manifest(corpus)
        verify_shards(m, ["train"])
        _epoch(m)
    assert not marker.exists()


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.tar", "train/../../outside.tar", "x.tar; rm -rf ~"])
def test_shard_names_must_stay_inside_the_corpus(tmp_path, corpus, bad):
    (tmp_path / "outside.tar").write_bytes((corpus / "train-000000.tar").read_bytes())
    _edit(corpus, lambda raw: raw["splits"]["train"]["shards"][0].update(name=bad))
    with pytest.raises(DataError, match=r"manifest.json names shard .*relative to the corpus"):
        m = load_manifest(corpus)
        verify_shards(m, ["train"], checksums=False)


def test_a_shard_symlinked_out_of_the_corpus_is_refused(tmp_path, corpus):
    outside = tmp_path / "elsewhere.tar"
    shutil.move(corpus / "train-000001.tar", outside)
    os.symlink(outside, corpus / "train-000001.tar")
    with pytest.raises(DataError, match=r"train-000001.tar \(named as shard in .*manifest.json\) is a symlink .* outside"):
        verify_shards(load_manifest(corpus), ["train"])


@pytest.mark.parametrize("bad", ["/etc", "../c2/tokenizer"])
def test_the_tokenizer_path_must_stay_inside_the_corpus(tmp_path, corpus, bad):
    shutil.copytree(corpus / "tokenizer", tmp_path / "c2" / "tokenizer")
    _edit(corpus, lambda raw: raw["tokenizer"].update(path=bad))
    with pytest.raises(DataError, match=r"manifest.json names the tokenizer path"):
        load_manifest(corpus)


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_link_members_in_a_shard_are_refused(tmp_path, link):
    corpus = cf.make_bert_corpus(tmp_path / "c", train_sizes=(25, 11, 7), val_sizes=(8,), version=1)
    shard = corpus / "train-000002.tar"
    members = []
    with tarfile.open(shard) as tf:
        for mem in tf:
            members.append((mem, tf.extractfile(mem).read()))
    with tarfile.open(shard, "w") as tf:  # the first sample's token file becomes a link
        for i, (mem, data) in enumerate(members):
            if i == 0:
                mem = tarfile.TarInfo(mem.name)
                mem.type = tarfile.SYMTYPE if link == "symlink" else tarfile.LNKTYPE
                mem.linkname = "/etc/passwd" if link == "symlink" else members[2][0].name
                tf.addfile(mem)
            else:
                tf.addfile(mem, io.BytesIO(data))
    _edit(corpus, lambda raw: [s.update(sha256="", bytes=0) for s in raw["splits"]["train"]["shards"]])
    m = load_manifest(corpus)
    with pytest.raises(DataError, match=r"train-000002.tar .*unsafe tar member: member '.*input_ids.u16' is a link"):
        _epoch(m, max_bad_share=1.0)


def test_streamed_shards_are_hashed_while_read(corpus):
    local = _epoch(load_manifest(corpus))
    shard = corpus / "train-000001.tar"
    blob = bytearray(shard.read_bytes())
    tokens = blob.index(b"\x02\x00", 512 + 128)  # a [CLS] id inside the first record's token array: still decodes
    blob[tokens + 2] ^= 0x01
    shard.write_bytes(bytes(blob))
    piped = load_manifest(corpus, url_prefix=f"pipe:cat {corpus}/")
    with pytest.raises(DataError, match=r"Shard train-000001.tar streamed from .*sha256 differs"):
        _epoch(piped, max_bad_share=1.0)
    assert len(local) == 40


def test_the_manifest_size_is_compared(corpus):
    shard = corpus / "train-000000.tar"
    shard.write_bytes(shard.read_bytes() + bytes(10240))
    _edit(corpus, lambda raw: raw["splits"]["train"]["shards"][0].update(sha256=""))
    with pytest.raises(DataError, match=r"train-000000.tar has 20480 bytes but .*manifest.json records 10240"):
        verify_shards(load_manifest(corpus), ["train"])
    piped = load_manifest(corpus, url_prefix=f"pipe:cat {corpus}/")
    with pytest.raises(DataError, match=r"train-000000.tar streamed .*streamed 20480 bytes, the manifest records 10240"):
        _epoch(piped, max_bad_share=1.0)


@pytest.mark.parametrize("how", ["no sha256", "verify_checksums=false"])
def test_a_truncated_shard_never_trains_silently(corpus, how):
    shard = corpus / "train-000000.tar"
    shard.write_bytes(shard.read_bytes()[: 3 * 1024])  # a third of its 25 samples survive
    if how == "no sha256":
        _edit(corpus, lambda raw: [s.update(sha256="", bytes=0) for s in raw["splits"]["train"]["shards"]])
    m = load_manifest(corpus)
    verify_shards(m, ["train"], checksums=how == "no sha256")
    with pytest.raises(DataError, match=r"samples read from .* are bad \(more than data.max_bad_share=0.001\).*shard train-000000.tar"):
        _epoch(m, verify_checksums=how == "no sha256")


def test_index_must_match_its_sha256(corpus):
    idx = corpus / "train-000000.idx.npy"
    rows = np.load(idx)
    rows[0, 0] += 512
    np.save(idx, rows)
    with pytest.raises(DataError, match=r"train-000000.idx.npy does not match the sha256"):
        _epoch(load_manifest(corpus))
    assert hashlib.sha256(idx.read_bytes()).hexdigest()  # the file is there; only its content is refused

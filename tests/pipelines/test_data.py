"""The streaming loader: manifest checks, rank/worker balance on uneven shards, exact seeking, bad samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import corpus_fixtures as cf
import numpy as np
import pytest
import torch

from core.corpus import DataError, load_manifest
from pipelines.engine import objectives as tasks
from pipelines.engine.config import RunConfig
from pipelines.loading import loader as data
from pipelines.loading.loader import StreamingSource


def _src(m, task, *, rank=0, world=1, workers=0, mb=4, buf=16, **kw):
    return StreamingSource(m, "train", task.collate, micro_batch_size=mb, rank=rank, world=world, num_workers=workers,
                           shuffle_buffer=buf, seed=3, **kw)


def _task(m):
    return tasks.build_task(RunConfig(), m)


def _keys(src, n):
    return [tuple(b["keys"]) for b in src.batches(limit=n)]


@pytest.fixture()
def uneven(tmp_path):
    return cf.make_bert_corpus(tmp_path / "c", train_sizes=(25, 11, 7), val_sizes=(8,))


def test_manifest_refusals_name_the_file(tmp_path, uneven):
    m = load_manifest(uneven, kind="bert_pairs")
    data.verify_shards(m, ["train", "validation"])
    with pytest.raises(DataError, match="packed_lm"):
        load_manifest(uneven, kind="packed_lm")
    raw = json.loads((uneven / "manifest.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(uneven, bad)
    (bad / "manifest.json").write_text(json.dumps({**raw, "schema_version": "3.0"}))
    with pytest.raises(DataError, match=r"manifest.json has schema_version '3.0'"):
        load_manifest(bad)
    (bad / "manifest.json").write_text(json.dumps(raw))
    (bad / "tokenizer/tokenizer.json").write_text((bad / "tokenizer/tokenizer.json").read_text().replace("river", "rivers"))
    with pytest.raises(DataError, match="tokenizer.json does not match the sha256"):
        load_manifest(bad)
    m = load_manifest(uneven)
    shard = uneven / "train-000001.tar"
    blob = bytearray(shard.read_bytes())
    blob[700] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(DataError, match=r"train-000001.tar has a different sha256"):
        data.verify_shards(m, ["train"])
    shard.unlink()
    with pytest.raises(DataError, match=r"train-000001.tar .* is missing"):
        data.verify_shards(m, ["train"])


def _global(m, t, *, world, mb, accum=1, workers=0, steps, state=None):
    """The keys of ``steps`` optimizer steps as the ranks of ``world`` read them, rank blocks in rank order;
    and the state every rank would checkpoint after them."""
    out, states = [[] for _ in range(steps)], []
    for rank in range(world):
        src = _src(m, t, rank=rank, world=world, mb=mb, workers=workers, grad_accum=accum)
        if state is not None:
            src.load_state_dict(state)
        for j, batch in enumerate(src.batches(limit=steps * accum)):
            out[j // accum] += list(batch["keys"])
        states.append(src.state_dict())
    return out, states


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_split_each_global_batch_and_an_epoch_is_a_permutation(uneven, workers):
    m = load_manifest(uneven)
    t = _task(m)
    steps, _ = _global(m, t, world=2, mb=4, workers=workers, steps=12)  # 96 samples of a 43-sample corpus
    flat = [k for step in steps for k in step]
    assert len(set(flat[:43])) == 43 and len(set(flat[43:86])) == 43  # epoch after epoch, nothing dropped
    assert flat[:43] != flat[43:86]  # a new order every epoch
    ranks = [_keys(_src(m, t, rank=r, world=2, mb=4, workers=workers), 12) for r in range(2)]
    assert all(len(b) == 4 for r in ranks for b in r) and all(set(ranks[0][j]).isdisjoint(ranks[1][j]) for j in range(12))


def test_the_sequence_does_not_depend_on_world_workers_or_micro_batch(uneven):
    m = load_manifest(uneven)
    t = _task(m)
    one, _ = _global(m, t, world=1, mb=8, steps=9)
    assert one == _global(m, t, world=2, mb=4, workers=2, steps=9)[0]
    assert one == _global(m, t, world=1, mb=4, accum=2, workers=2, steps=9)[0]
    assert one == _global(m, t, world=4, mb=1, accum=2, steps=9)[0]


def test_token_samples_are_read_only_views_of_their_cached_record(uneven):
    # handed out without a copy, a sample written to by a collate would change what the next epoch reads
    from pipelines.loading import shard_io

    m = load_manifest(uneven)
    got = shard_io.ShardReader(m).read(m.shards("train")[0], 0, 3)
    assert len(got) == 3 and all(not parts["input_ids"].flags.writeable for _, parts in got)


@pytest.mark.parametrize(("workers", "group"), [(1, 16), (2, 16), (3, 5), (2, 1)])
def test_worker_items_start_with_one_micro_batch_and_tile_the_stream(workers, group):
    spans = [data.item_span(i, workers, group) for i in range(60)]
    assert all(hi - lo == 1 for lo, hi in spans[:workers])  # the first batch waits for one micro-batch, not `group`
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))  # no gap, no overlap
    assert {hi - lo for lo, hi in spans[-workers:]} == {group}  # then about one shuffle window per item


@pytest.mark.parametrize(("before", "after"), [((2, 4, 1), (1, 8, 1)), ((1, 4, 2), (2, 2, 2)), ((2, 2, 2), (1, 2, 4))])
def test_resume_on_another_world_size_goes_on_with_the_next_global_sample(uneven, before, after):
    """(world, micro batch, accumulation) before and after the checkpoint; the global batch stays 8."""
    m = load_manifest(uneven)
    t = _task(m)
    reference, _ = _global(m, t, world=1, mb=8, steps=11)
    (w0, mb0, a0), (w1, mb1, a1) = before, after
    head, states = _global(m, t, world=w0, mb=mb0, accum=a0, workers=2, steps=5)
    state = json.loads(json.dumps(states[-1]))  # as a checkpoint stores it; every rank's is the same position
    assert all(st["position"] == 40 for st in states)
    tail, _ = _global(m, t, world=w1, mb=mb1, accum=a1, workers=2, steps=6, state=state)
    assert head + tail == reference


@pytest.mark.parametrize("workers", [0, 2])
def test_seek_resumes_exactly_without_reading_consumed_shards(tmp_path, uneven, workers):
    m = load_manifest(uneven)
    t = _task(m)
    full = _keys(_src(m, t, rank=1, world=2, workers=workers), 12)
    first = _src(m, t, rank=1, world=2, workers=workers)
    head = _keys(first, 9)  # 9 steps of 8 = 72 global samples: into the second epoch (43 samples each)
    state = first.state_dict()
    assert state["position"] == 72 and state["epoch"] == 1
    # Shards the resumed position does not need may be unreadable: resume seeks, it does not replay.
    copy = tmp_path / "copy"
    shutil.copytree(uneven, copy)
    m2 = load_manifest(copy)
    seq = data.CorpusSequence(m2, "train", seed=3, shuffle=True, window=16)
    epoch, window_start, _, _ = seq.locate(72)
    offset, untouched = 0, []
    for s in seq.order(epoch):
        if offset + s.samples <= window_start:
            untouched.append(s.name)
        offset += s.samples
    assert untouched
    for name in untouched:
        (copy / name).write_bytes(b"garbage")
    resumed = _src(m2, _task(m2), rank=1, world=2, workers=workers)
    resumed.load_state_dict(state)
    assert head + _keys(resumed, 1) == full[:10]  # the rest of epoch 1 (epoch 2 needs the other shards)
    intact = _src(m, t, rank=1, world=2, workers=workers)
    intact.load_state_dict(state)
    assert head + _keys(intact, 3) == full


def test_pipe_urls_stream_like_local_files(tmp_path, uneven):
    m = load_manifest(uneven)
    t = _task(m)
    local = _keys(_src(m, t), 6)
    m2 = load_manifest(uneven, url_prefix=f"pipe:cat {uneven}/")  # the user's own data.url_prefix
    assert m2.url(m2.splits["train"][0]) == f"pipe:cat {uneven}/train-000000.tar"
    assert _keys(_src(m2, _task(m2)), 6) == local


def test_bad_samples_are_replaced_counted_or_fail(tmp_path, uneven):
    m = load_manifest(uneven)
    shard = uneven / "train-000002.tar"
    data_bytes = shard.read_bytes()
    shard.write_bytes(data_bytes[:1500])  # truncated inside its (only) record
    t = _task(m)
    batches = list(_src(m, t, buf=64, max_bad_share=1.0).batches(limit=10))  # all of epoch 0 of one rank: 43 // 4
    assert len(batches) == 10 and sum(b["num_bad"] for b in batches) > 0
    with pytest.raises(DataError, match="train-000002.tar"):
        list(_src(m, t, buf=64, on_bad_sample="fail").batches(limit=10))
    with pytest.raises(DataError, match=r"max_bad_share=0.001.*train-000002.tar"):  # the default stops the run
        list(_src(m, t, buf=64).batches(limit=10))


def test_mlm_masking_80_10_10_is_keyed_not_global():
    class M:
        special_tokens = {"pad_token": 0, "unk_token": 1, "cls_token": 2, "sep_token": 3, "mask_token": 4}
        vocab_size, seq_len, root = 100, 128, Path(".")

    task = tasks.MLMNSPTask(M(), seed=0)
    rng = np.random.default_rng(0)
    ids = np.r_[[2], rng.integers(5, 100, 120), [3]]
    selected = masked = kept = 0
    for k in range(300):
        out, labels = task.mask(ids, np.random.default_rng(k))
        sel = labels != -100
        assert not sel[0] and not sel[-1]  # specials never selected
        selected += sel.sum()
        masked += (out[sel] == 4).sum()
        kept += (out[sel] == ids[sel]).sum()
    assert selected == 300 * round(120 * 0.15)
    assert abs(masked / selected - 0.8) < 0.03 and abs(kept / selected - 0.1 - 0.01) < 0.03
    a, _ = task.mask(ids, np.random.default_rng(tasks.key_seed(0, 1, "k")))
    b, _ = task.mask(ids, np.random.default_rng(tasks.key_seed(0, 1, "k")))
    assert (a == b).all()


def test_whole_word_masking_masks_all_pieces(tmp_path):
    root = cf.make_bert_corpus(tmp_path / "c", train_sizes=(8,), val_sizes=(8,))
    m = load_manifest(root)
    task = tasks.MLMNSPTask(m, seed=0, probability=0.5, whole_word=True)
    vocab = json.loads((root / "tokenizer/tokenizer.json").read_text())["model"]["vocab"]
    ids = np.array([2] + [vocab["cat"], vocab["##s"], vocab["dog"], vocab["##ing"], vocab["##s"]] * 4 + [3])
    for k in range(20):
        _, labels = task.mask(ids, np.random.default_rng(k))
        sel = labels != -100
        for i in range(1, len(ids) - 1):
            if ids[i] in (vocab["##s"], vocab["##ing"]):
                assert sel[i] == sel[i - 1]


def test_mlm_batches_carry_the_masked_positions_the_labels_mark(tmp_path):
    """The sparse MLM head's rows, as flat indices into the padded [B, T] batch (models/bert.py)."""
    root = cf.make_bert_corpus(tmp_path / "c", train_sizes=(8,), val_sizes=(8,))
    m = load_manifest(root)
    task = tasks.MLMNSPTask(m, seed=0)
    samples = [data.decode_sample("bert_pairs", k, p) for _, k, p in data.read_samples(m, m.shards("train"), 0, 8)]
    batch = task.collate(samples, epoch=0, train=True)
    flat = batch["labels"].reshape(-1)
    assert batch["masked_positions"].dtype == torch.int64 and len(batch["masked_positions"]) > 0
    assert torch.equal(batch["masked_positions"], (flat != -100).nonzero()[:, 0])
    assert "masked_positions" in task.model_inputs(batch)


def test_image_transforms_and_mixup(tmp_path):
    root = cf.make_image_corpus(tmp_path / "img", train_sizes=(8,), val_sizes=(8,), size=40)
    m = load_manifest(root, kind="images")
    task = tasks.ImageClsTask(m, seed=0, image_size=32, mixup_alpha=0.4)
    samples = [s for s in (data.decode_sample("images", k, p) for _, k, p in data.read_samples(m, m.shards("train"), 0, 4))]
    train = task.collate(samples, epoch=0, train=True)
    assert train["pixel_values"].shape == (4, 3, 32, 32)
    assert train["labels"].shape == (4, 4) and np.allclose(train["labels"].sum(1).numpy(), 1.0)
    ev1, ev2 = task.collate(samples, epoch=0, train=False), task.collate(samples, epoch=5, train=False)
    assert (ev1["pixel_values"] == ev2["pixel_values"]).all() and ev1["labels"].dtype.is_floating_point is False
    other = task.collate(samples, epoch=1, train=True)
    assert not (other["pixel_values"] == train["pixel_values"]).all()


def test_map_style_source_balances_and_seeks():
    items = list(range(23))
    collate = lambda b: {"x": b}  # noqa: E731
    ranks = [data.MapStyleSource(items, collate, micro_batch_size=3, rank=r, world=2, seed=1) for r in range(2)]
    got = [[b["x"] for b in s.batches(limit=3)] for s in ranks]
    assert len(got[0]) == len(got[1]) == 3 and not set(sum(got[0], [])) & set(sum(got[1], []))
    a = data.MapStyleSource(items, collate, micro_batch_size=3, rank=0, world=2, seed=1)
    full = [b["x"] for b in a.batches(limit=8)]
    b = data.MapStyleSource(items, collate, micro_batch_size=3, rank=0, world=2, seed=1)
    head = [x["x"] for x in b.batches(limit=5)]
    c = data.MapStyleSource(items, collate, micro_batch_size=3, rank=0, world=2, seed=1)
    c.load_state_dict(b.state_dict())
    assert head + [x["x"] for x in c.batches(limit=3)] == full


def test_map_style_source_with_a_filler_keeps_the_last_partial_batch():
    """Fine-tuning passes over every item each epoch, the last batch partial (a DataLoader without
    drop_last); a rank whose share of that batch is empty gets the filler so every rank takes the step."""
    items = list(range(13))
    collate = lambda b: {"x": b}  # noqa: E731
    ranks = [data.MapStyleSource(items, collate, micro_batch_size=3, rank=r, world=2, seed=1, filler="pad") for r in range(2)]
    assert ranks[0].batches_per_epoch == 3  # ceil(13 / 6); 2 when the last 1 item is dropped
    epochs = [[b["x"] for b in s.batches(limit=6)] for s in ranks]  # two epochs
    for e in range(2):
        real = sorted(x for r in range(2) for batch in epochs[r][3 * e: 3 * e + 3] for x in batch if x != "pad")
        assert real == items  # every item once per epoch
    assert [len(b) for b in epochs[0][:3]] == [3, 3, 1] and epochs[1][2] == ["pad"]
    assert epochs[0][:3] != epochs[0][3:]  # reshuffled per epoch
    single = data.MapStyleSource(items, collate, micro_batch_size=4, seed=1, filler="pad")
    assert [len(b["x"]) for b in single.batches(limit=4)] == [4, 4, 4, 1]
    b = data.MapStyleSource(items, collate, micro_batch_size=3, rank=0, world=2, seed=1, filler="pad")
    head = [x["x"] for x in b.batches(limit=4)]
    c = data.MapStyleSource(items, collate, micro_batch_size=3, rank=0, world=2, seed=1, filler="pad")
    c.load_state_dict(b.state_dict())
    assert head + [x["x"] for x in c.batches(limit=2)] == epochs[0]  # resume mid-epoch, across the boundary


@pytest.mark.parametrize("workers", [0, 2])
def test_format_1_corpora_still_train_with_a_warning(tmp_path, caplog, workers):
    v2 = load_manifest(cf.make_bert_corpus(tmp_path / "v2", train_sizes=(25, 11, 7), val_sizes=(8,)))
    v1 = load_manifest(cf.make_bert_corpus(tmp_path / "v1", train_sizes=(25, 11, 7), val_sizes=(8,), version=1))
    assert "corpus format 1.0, which is deprecated" in caplog.text and v1.version == (1, 0) and v2.version == (2, 0)
    got = [_src(m, _task(m), workers=workers).batches(limit=12) for m in (v1, v2)]
    for b1, b2 in zip(*got, strict=True):  # same samples at the same positions (masks are keyed, keys differ)
        unmasked = [np.where(b["labels"].numpy() != -100, b["labels"].numpy(), b["input_ids"].numpy()) for b in (b1, b2)]
        assert np.array_equal(*unmasked)
        assert np.array_equal(b1["next_sentence_label"].numpy(), b2["next_sentence_label"].numpy())


def test_an_epoch_reads_each_shard_byte_about_once(tmp_path):
    from pipelines.loading import shard_io

    root = cf.make_gpt_corpus(tmp_path / "g", train_sizes=(300, 260), val_sizes=(8,))
    m = load_manifest(root)
    read = []

    class Counting:
        def __init__(self, fh):
            self.fh = fh

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def read(self, n=-1):
            data = self.fh.read(n)
            read.append(len(data))
            return data

    reader = shard_io.ShardReader(m)
    opened = reader._file
    reader._file = lambda url: Counting(opened(url))
    shards = m.shards("train")
    total = sum(s.samples for s in shards)
    got = []
    for start in range(0, total, 50):  # consecutive 50-sample windows, as a worker's span reads them
        got += [k for _, k, _ in shard_io.read_samples(m, shards, start, min(50, total - start), reader)]
    assert len(set(got)) == total
    records = sum(int(np.load(root / s.index["name"])[:, 1].sum()) for s in shards)  # all but the tar end padding
    assert sum(read) == records and len(read) <= -(-total // 50)  # every record read once, one read per window


@pytest.mark.parametrize("workers", [0, 2])
def test_an_evaluation_pass_reads_every_sample_once_across_ranks_with_equal_forward_counts(uneven, workers):
    """43 samples, 2 ranks x 4: the last global batch is partial (3 samples on rank 0, none on rank 1);
    every sample is counted exactly once and both ranks run the same number of forwards (no ZeRO-3 hang)."""
    m = load_manifest(uneven)
    t = _task(m)
    per_rank = [list(_src(m, t, rank=r, world=2, mb=4, workers=workers, shuffle=False, train=False).evaluation_batches())
                for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 6
    counted = [k for rank in per_rank for batch, c in rank if c for k in batch["keys"]]
    assert len(counted) == 43 and len(set(counted)) == 43
    assert [c for _, c in per_rank[1]] == [True] * 5 + [False]
    items = list(range(23))
    sources = [data.MapStyleSource(items, lambda b: {"x": b}, micro_batch_size=3, rank=r, world=2, shuffle=False)
               for r in range(2)]
    seen = [x for s in sources for batch, c in s.evaluation_batches() if c for x in batch["x"]]
    assert sorted(seen) == items
    limited = list(sources[0].evaluation_batches(limit=2))
    assert [b["x"] for b, _ in limited] == [[0, 1, 2], [6, 7, 8]]

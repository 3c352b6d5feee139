"""Inputs that used to give a traceback or silent damage now give one message naming the file and line."""

from __future__ import annotations

import tarfile

import pytest

from pipelines.finetune.data import FinetuneError, read_examples


def _tsv(path, rows):
    path.write_text("text\tlabel\n" + "".join(f"{t}\t{lab}\n" for t, lab in rows), encoding="utf-8")
    return path


def test_non_utf8_tsv_names_the_file_and_line(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_bytes(b"text\tlabel\ngood film\tpos\n" + "tr\xe8s bien\tpos\n".encode("latin-1"))
    with pytest.raises(FinetuneError) as err:
        read_examples(path, text_column="text", label_column="label")
    assert str(path) in str(err.value) and "not UTF-8" in str(err.value) and "line 3" in str(err.value)


@pytest.mark.parametrize("variant", ["Pos", " pos", "pos "])
def test_label_case_or_space_variant_is_refused_before_training(tmp_path, variant):
    rows = [(f"review {i}", "pos" if i % 2 else "neg") for i in range(40)] + [("one more", variant)]
    with pytest.raises(FinetuneError) as err:
        read_examples(_tsv(tmp_path / "train.tsv", rows), text_column="text", label_column="label")
    msg = str(err.value)
    assert "differ only in case or spaces" in msg and repr(variant) in msg
    assert f"{tmp_path / 'train.tsv'}:42" in msg  # the odd row's line


def test_a_label_seen_once_among_common_ones_is_reported(tmp_path):
    rows = [(f"review {i}", ["pos", "neg", "neutral"][i % 3]) for i in range(90)] + [("odd", "postive")]
    examples, labels, report = read_examples(_tsv(tmp_path / "train.tsv", rows), text_column="text", label_column="label")
    assert "postive" in labels and len(examples) == 91  # kept (it may be real), but reported
    assert "label 'postive' appears once" in report.summary() and "train.tsv:92" in report.summary()
    clean, _, clean_report = read_examples(_tsv(tmp_path / "ok.tsv", rows[:90]), text_column="text", label_column="label")
    assert "warning" not in clean_report.summary()


def test_the_read_summary_counts_the_examples_kept_apart_from_the_skipped(tmp_path):
    """It said "754 examples, skipped 1" for 753 kept: the total counted the skipped row too."""
    rows = [(f"review {i}", "pos" if i % 2 else "neg") for i in range(200)] + [("", "pos")]  # 0.5 %: under the limit
    examples, _, report = read_examples(_tsv(tmp_path / "train.tsv", rows), text_column="text", label_column="label")
    assert len(examples) == 200
    assert f"{tmp_path / 'train.tsv'}: 201 examples read, 200 kept, 1 skipped: 1 empty text (first at" in report.summary()


# ---- corpora: a worker's error is the main process' error; samples are checked against the model -----------


def _train(corpus, run_dir, capsys, monkeypatch, *extra: str) -> tuple[int, str]:
    """`pretrain train` (the CLI's main, in this process) on ``corpus`` for 2 steps of a tiny BERT."""
    from reliability_helpers import REPO

    from pipelines.cli import main
    from pipelines.engine.distributed import in_process_run

    monkeypatch.chdir(REPO)
    argv = ["train", "configs/train/bert_tiny_cpu.yaml", f"data.corpus={corpus}", f"train.run_dir={run_dir}",
            "train.max_steps=2", "train.eval_every=0", "train.checkpoint_every=0", "data.micro_batch_size=4",
            "data.shuffle_buffer=16", "distributed.engine=ddp", "distributed.zero_stage=0", *extra]
    with in_process_run():
        code = main(argv)
    return code, capsys.readouterr().err


def _one_paragraph(err: str) -> str:
    assert "Traceback" not in err and "Caught" not in err and "worker process" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _corpus(tmp_path):
    import corpus_fixtures as cf

    return cf.make_bert_corpus(tmp_path / "corpus", train_sizes=(48,), val_sizes=(8,))  # 3 records of 16 samples


def _reseal_sha(corpus, name="train-000000.tar"):
    import hashlib

    from reliability_helpers import edit_manifest

    sha = hashlib.sha256((corpus / name).read_bytes()).hexdigest()
    edit_manifest(corpus, lambda raw: [s.update(sha256=sha) for s in raw["splits"]["train"]["shards"] if s["name"] == name])


def _retype_first_member(corpus, typeflag: bytes) -> None:
    """Record 0's first tar member becomes a link (type flag and header checksum rewritten, sha256 re-recorded)."""
    shard = corpus / "train-000000.tar"
    blob = bytearray(shard.read_bytes())
    blob[156:157] = typeflag
    blob[157:161] = b"/etc"  # linkname
    blob[148:156] = b" " * 8
    blob[148:156] = b"%06o\0 " % sum(blob[:512])
    shard.write_bytes(bytes(blob))
    _reseal_sha(corpus)


def _break_header(corpus) -> None:
    shard = corpus / "train-000000.tar"
    blob = bytearray(shard.read_bytes())
    blob[148:156] = b"garbage!"  # record 0's first header no longer parses (the manifest's sha256 now differs)
    shard.write_bytes(bytes(blob))


def _truncate(corpus) -> None:
    from reliability_helpers import edit_manifest

    shard = corpus / "train-000000.tar"
    shard.write_bytes(shard.read_bytes()[: 3 * 1024])
    edit_manifest(corpus, lambda raw: [s.update(sha256="", bytes=0) for s in raw["splits"]["train"]["shards"]])


def _object_npy(corpus) -> None:
    import io

    import numpy as np
    from reliability_helpers import rewrite_shard

    def edit(r, key, members, n):
        if r == 1:
            buf = io.BytesIO()
            np.save(buf, np.array([1, "x"], dtype=object), allow_pickle=True)
            members["input_ids.npy"] = buf.getvalue()
        return key, members, n

    rewrite_shard(corpus, "train-000000.tar", edit)


def _missized(corpus) -> None:
    from reliability_helpers import rewrite_shard

    rewrite_shard(corpus, "train-000000.tar", lambda r, key, members, n: (key, members, n + (1, -1, 0)[r]))


WORKER_CASES = {
    "bad tar header, verify_checksums=false": (_break_header, {"verify_checksums": False}),
    "truncated shard without sizes": (_truncate, {}),
    "symlink member": (lambda c: _retype_first_member(c, tarfile.SYMTYPE), {}),
    "hardlink member": (lambda c: _retype_first_member(c, tarfile.LNKTYPE), {}),
    "object-dtype .npy": (_object_npy, {}),
    "a record the index mis-sizes": (_missized, {}),
}


@pytest.mark.parametrize("case", sorted(WORKER_CASES))
def test_a_worker_error_is_the_same_one_paragraph_the_main_process_gives(tmp_path, case):
    from core.corpus import DataError, load_manifest
    from pipelines.engine import objectives as tasks
    from pipelines.engine.config import RunConfig
    from pipelines.loading.loader import StreamingSource

    corpus = _corpus(tmp_path)
    damage, kw = WORKER_CASES[case]
    damage(corpus)
    m = load_manifest(corpus)
    messages = []
    for workers in (0, 1):
        src = StreamingSource(m, "train", tasks.build_task(RunConfig(), m).collate, micro_batch_size=4, rank=0, world=1,
                              num_workers=workers, shuffle_buffer=16, **kw)
        with pytest.raises(DataError) as err:
            for _ in src.batches(limit=src.batches_per_epoch):
                pass
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "train-000000" in messages[1], messages
    assert "Caught" not in messages[1] and "Traceback" not in messages[1] and "\n" not in messages[1]


def test_the_cli_prints_a_workers_data_error_as_one_paragraph(tmp_path, capsys, monkeypatch):
    corpus = _corpus(tmp_path)
    _retype_first_member(corpus, tarfile.SYMTYPE)
    code, err = _train(corpus, tmp_path / "run", capsys, monkeypatch, "data.num_workers=1")
    line = _one_paragraph(err)
    assert code == 2 and "train-000000.tar" in line and "unsafe tar member" in line


@pytest.mark.slow
def test_a_ranks_data_error_under_two_processes_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """`pretrain train ... --nproc 2` on a crafted shard: each rank stops on it, and the user reads the error
    once (not once per rank) and no launcher traceback -- as with one process."""
    from reliability_helpers import REPO

    from pipelines.cli import main

    corpus = _corpus(tmp_path)
    _retype_first_member(corpus, tarfile.SYMTYPE)
    monkeypatch.chdir(REPO)
    code = main(["train", "configs/train/bert_tiny_cpu.yaml", f"data.corpus={corpus}", f"train.run_dir={tmp_path / 'run'}",
                 "train.max_steps=2", "train.eval_every=0", "data.micro_batch_size=4", "data.shuffle_buffer=16",
                 "distributed.engine=ddp", "distributed.zero_stage=0", "--nproc", "2"])
    err = capsys.readouterr().err
    line = _one_paragraph(err)
    assert code == 2 and "train-000000.tar" in line and "unsafe tar member" in line
    assert "ChildFailedError" not in err and "Root Cause" not in err and "closing signal" not in err, err


# The elastic agent's output after both ranks of a 2-process run stopped with exit code 2 (torch 2.13).
_AGENT_REPORT = """\
W1126 09:30:19.658000 31635 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] \
Sending process 31641 closing signal SIGTERM
Traceback (most recent call last):
  File ".venv/bin/accelerate", line 6, in <module>
    sys.exit(main())
             ^^^^^^
  File ".venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pipelines.pretrain FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 31640)
============================================================
"""
_CRASH = """\
Traceback (most recent call last):
  File "pipelines/pretrain.py", line 45, in main
    summary = train(cfg)
RuntimeError: a bug, not the user's input
"""


@pytest.mark.parametrize("rank_lines", ["error", "crash"])
def test_launch_output_drops_the_agents_report_only_after_a_ranks_error_line(rank_lines, capsys):
    import io

    from pipelines.engine.launch_output import LaunchOutput

    error = "error: Shard c/train-000000.tar of c/manifest.json holds an unsafe tar member.\n"
    ranks = error + "a warning a user should see\n" + error if rank_lines == "error" else _CRASH
    out = LaunchOutput(io.BytesIO((ranks + _AGENT_REPORT + "after\n").encode()))
    out.join()
    shown = capsys.readouterr().err
    if rank_lines == "error":  # the error once, the warning kept, the report and the agent's lines gone
        assert shown == error + "a warning a user should see\nafter\n" and out.dropped_report
    else:  # no rank explained itself: everything passes, the agent's report included
        assert shown == _CRASH + _AGENT_REPORT + "after\n" and not out.dropped_report


def test_a_token_id_outside_the_vocabulary_is_a_bad_sample_naming_its_shard(tmp_path, capsys, monkeypatch):
    import numpy as np
    from reliability_helpers import rewrite_shard

    from core.records import npy_array, npy_bytes

    corpus = _corpus(tmp_path)

    def edit(r, key, members, n):
        ids = npy_array(members["input_ids.npy"]).copy()
        ids[ids == 2] = 60000  # every [CLS]: an id far past the tokenizer's vocabulary
        members["input_ids.npy"] = npy_bytes(ids.astype(np.uint16))
        return key, members, n

    rewrite_shard(corpus, "train-000000.tar", edit)
    code, err = _train(corpus, tmp_path / "run", capsys, monkeypatch, "data.num_workers=0")
    line = _one_paragraph(err)
    assert code == 2 and "max_bad_share" in line and "train-000000.tar" in line, line
    assert "token id 60000 is outside the vocabulary" in line, line


def test_a_sample_longer_than_the_models_positions_is_a_bad_sample(tmp_path, capsys, monkeypatch):
    """Samples of up to 32 tokens in a corpus whose manifest says seq_len 16, for a model of 16 positions."""
    from reliability_helpers import edit_manifest

    corpus = _corpus(tmp_path)
    edit_manifest(corpus, lambda raw: raw.update(seq_len=16))
    code, err = _train(corpus, tmp_path / "run", capsys, monkeypatch, "data.num_workers=0",
                       "model.overrides={max_position_embeddings: 16}")
    line = _one_paragraph(err)
    assert code == 2 and "max_bad_share" in line and "train-000000.tar" in line, line
    assert "more than the 16 the model and the corpus' seq_len allow" in line, line


@pytest.mark.parametrize("sizes", ["recorded", "cleared"])
def test_an_index_row_past_the_shards_end_is_refused(tmp_path, capsys, monkeypatch, sizes):
    """The second of two index rows at byte 2**40 (its sha256 re-recorded; one window reads both records): no
    MemoryError, one message naming the shard (the shard's size recorded: the index is refused; not: its samples are bad)."""
    import hashlib

    import corpus_fixtures as cf
    import numpy as np
    from reliability_helpers import edit_manifest

    corpus = cf.make_bert_corpus(tmp_path / "corpus", train_sizes=(32,), val_sizes=(8,))
    path = corpus / "train-000000.idx.npy"
    rows = np.load(path)
    rows[-1, 0] = 2**40
    np.save(path, rows)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()

    def reseal(raw):
        entry = raw["splits"]["train"]["shards"][0]
        entry["index"]["sha256"] = sha
        if sizes == "cleared":
            entry.update(bytes=0, sha256="")

    edit_manifest(corpus, reseal)
    code, err = _train(corpus, tmp_path / "run", capsys, monkeypatch, "data.num_workers=0", "data.shuffle_buffer=32")
    line = _one_paragraph(err)
    assert code == 2 and "train-000000" in line, line
    assert ("past the shard's" in line) if sizes == "recorded" else ("max_bad_share" in line), line


@pytest.mark.parametrize("version", [1, 2])
def test_sample_limits_hold_for_both_corpus_formats(tmp_path, version):
    """Format 1 (a sample per tar record, checked per sample) and format 2 (checked per record): the same bad sample."""
    import corpus_fixtures as cf

    from core.corpus import DataError, load_manifest
    from pipelines.engine import objectives as tasks
    from pipelines.engine.config import RunConfig
    from pipelines.loading.loader import SampleLimits, StreamingSource

    m = load_manifest(cf.make_bert_corpus(tmp_path / "c", train_sizes=(32,), val_sizes=(8,), version=version))
    for limits, why in ((SampleLimits(max_tokens=8), "more than the 8"), (SampleLimits(vocab_size=5), "outside the vocabulary [0, 5)")):
        src = StreamingSource(m, "train", tasks.build_task(RunConfig(), m).collate, micro_batch_size=4, rank=0, world=1,
                              shuffle_buffer=16, on_bad_sample="fail", limits=limits)
        with pytest.raises(DataError, match=r"Bad sample \S+ in shard train-000000.tar .*" + why.replace("[", r"\[").replace(")", r"\)")):
            next(src.batches(limit=1))
    src = StreamingSource(m, "train", tasks.build_task(RunConfig(), m).collate, micro_batch_size=4, rank=0, world=1,
                          shuffle_buffer=16, on_bad_sample="fail", limits=SampleLimits(max_tokens=32, vocab_size=m.vocab_size))
    assert sum(len(b["keys"]) for b in src.batches(limit=src.batches_per_epoch)) == 32  # within the limits: nothing bad

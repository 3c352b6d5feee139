"""Ranges of one input file (issue #34): together they yield exactly the records of a whole-file read.

The unit tests read the ranges the driver plans with the workers' reader; the jobs at the end
run on real Ray and compare the corpus bytes of split vs unsplit and 1 vs 2 workers.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

import data_prep.job as job
from data_prep.config import PrepConfig, SourceConfig, TokenizerConfig
from data_prep.ranges import range_bytes_for, split_entries
from data_prep.sources import describe_where, iter_text_records


def _paragraph_text(n: int, seed: int = 0) -> bytes:
    """Paragraphs of very different lengths (some longer than a range), separated by 1-3 blank lines of
    varied whitespace, with CRLF lines, an invalid UTF-8 paragraph and no final newline."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lines = [f"doc {i} line {j}: " + "word " * rng.randint(1, 40) for j in range(rng.choice([1, 2, 5, 30]))]
        body = "\n".join(lines).encode()
        if i % 17 == 3:
            body = body.replace(b"\n", b"\r\n")
        if i == 40:
            body += b"\xff\xfe broken"
        out.append(body)
        out.append(rng.choice([b"\n\n", b"\n \n", b"\n\t\r\n\n", b"\n\n\n"]))
    return b"".join(out).rstrip(b"\n")


def _records(path: Path, src: SourceConfig, range_bytes: int) -> tuple[list, int]:
    entry = {"path": str(path), "source": 0, "size": path.stat().st_size, "label": -1}
    ranges = split_entries([entry], [src], range_bytes)
    return [r for e in ranges for r in iter_text_records(str(path), src, e.get("span"))], len(ranges)


@pytest.mark.parametrize("range_bytes", [1, 100, 777, 4096])
def test_paragraph_ranges_yield_the_whole_files_documents_and_cut_none(tmp_path, range_bytes):
    path = tmp_path / "big.txt"
    path.write_bytes(_paragraph_text(200))
    src = SourceConfig(type="text", paths=[str(path)], text_mode="paragraphs")
    whole = list(iter_text_records(str(path), src))
    split, n = _records(path, src, range_bytes)
    assert n > 10 and split == whole and any(r[:2] == (None, "invalid_utf8") for r in whole)
    data = path.read_bytes()
    entry = {"path": str(path), "source": 0, "size": len(data), "label": -1}
    for r in split_entries([entry], [src], range_bytes)[1:]:
        before = data[: r["span"][0]].splitlines(keepends=True)[-1]
        assert before.endswith(b"\n") and not before.strip()  # every cut follows a blank line


def test_jsonl_ranges_cut_at_lines_and_count_bad_lines_once(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "ü" * (i % 50)}).encode() for i in range(300)]
    lines[7], lines[90], lines[150] = b'{"text": "truncated', b'{"other": 1}', b"\xff\xfe not utf8"
    lines.insert(200, b"   ")
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    src = SourceConfig(type="jsonl", paths=[str(path)])
    whole = list(iter_text_records(str(path), src))
    split, n = _records(path, src, 512)
    assert n > 10 and split == whole
    bad = {rule: describe_where(str(path), where) for _, rule, where in whole if rule}
    assert bad == {"bad_json": "line 8", "missing_field": "line 91", "invalid_utf8": "line 151"}


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_big_blank_file_is_one_empty_file(tmp_path, kind):
    path = tmp_path / f"blank.{kind}"
    path.write_bytes(b" \n\n\t\n" * 5000)
    src = SourceConfig(type=kind, paths=[str(path)])
    split, n = _records(path, src, 1000)
    assert n > 1 and split == [(None, "empty_file", None)]


def test_parquet_ranges_are_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "big.parquet"
    texts = [f"row {i} " + "x" * (i % 300) if i % 97 else None for i in range(5000)]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=400)
    src = SourceConfig(type="parquet", paths=[str(path)])
    whole = list(iter_text_records(str(path), src))
    split, n = _records(path, src, 20_000)
    assert 3 <= n <= pq.ParquetFile(path).metadata.num_row_groups and split == whole
    assert [where for _, rule, where in split if rule] == [("row", i) for i in range(0, 5000, 97)]  # rows of the file
    missing = SourceConfig(type="parquet", paths=[str(path)], text_field="body")
    assert _records(path, missing, 20_000)[0] == list(iter_text_records(str(path), missing))


def test_file_mode_text_and_small_files_stay_whole(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(_paragraph_text(50))
    entry = {"path": str(path), "source": 0, "size": path.stat().st_size, "label": -1}
    assert split_entries([entry], [SourceConfig(type="text", paths=["x"], text_mode="file")], 100) == [entry]
    assert split_entries([entry], [SourceConfig(type="text", paths=["x"])], 0) == [entry]
    assert split_entries([entry], [SourceConfig(type="text", paths=["x"])], entry["size"]) == [entry]
    # default 64 MB, but 4 pieces per worker on a corpus of one 40 MB file, never below 1 MB unless configured
    assert range_bytes_for(64, 40_000_000, 2) == 5_000_000 and range_bytes_for(64, 2_000_000, 2) == 1_000_000
    assert range_bytes_for(0.004, 40_000_000, 2) == 4000 and range_bytes_for(0, 40_000_000, 2) == 0


# ------------------------------------------------------------------------------------------
# Whole jobs on real Ray: split vs unsplit, 1 vs 2 workers, byte for byte
# ------------------------------------------------------------------------------------------


def _digest(corpus: Path) -> dict[str, str]:
    files = [p for p in sorted(corpus.rglob("*")) if p.is_file() and ".state" not in p.parts]
    return {str(p.relative_to(corpus)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def one_big_file(tmp_path_factory) -> dict[str, Path]:
    """pydoc_data's topics (always installed) as one paragraphs text file, one JSONL and one Parquet file (~0.5 MB each)."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("one_file")
    docs = [v for _, v in sorted(topics.items())]
    (root / "topics.txt").write_text("\n\n".join(docs), encoding="utf-8")
    paragraphs = [p for d in docs for p in d.split("\n\n")]
    (root / "topics.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs), encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": paragraphs}), root / "topics.parquet", row_group_size=200)
    return {"text": root / "topics.txt", "jsonl": root / "topics.jsonl", "parquet": root / "topics.parquet"}


def _run(monkeypatch, cfg: PrepConfig) -> tuple[dict[str, str], int]:
    """Digest of the corpus `cfg` writes, and how many map tasks read its input."""
    tasks = []
    real = job.chunk_entries
    monkeypatch.setattr(job, "chunk_entries", lambda entries, n: tasks.append(out := real(entries, n)) or out)
    job.run_prepare(cfg)
    return _digest(Path(cfg.output)), len(tasks[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_one_big_file_gives_identical_bytes_split_or_not_with_one_or_two_workers(ray_cluster, one_big_file, tmp_path, monkeypatch, kind):
    def cfg(name: str, workers: int, range_mb: float) -> PrepConfig:
        return PrepConfig(kind="bert_pairs", output=str(tmp_path / name), seq_len=64, validation_fraction=0.1,
                          shard_target_mb=0.1, progress=False, num_workers=workers, input_range_mb=range_mb,
                          sources=[SourceConfig(type=kind, paths=[str(one_big_file[kind])])],
                          tokenizer=TokenizerConfig(vocab_size=3000))

    whole, tasks_whole = _run(monkeypatch, cfg("whole", 2, 0))
    split2, tasks_split = _run(monkeypatch, cfg("split2", 2, 0.004))
    split1, _ = _run(monkeypatch, cfg("split1", 1, 0.004))
    assert tasks_whole == 1 and tasks_split == 8  # 4 per worker, from many ranges of ~4 kB (or one row group each)
    assert split2 == whole and split1 == whole and len([k for k in whole if k.endswith(".tar")]) >= 3
    manifest = json.loads((tmp_path / "split2" / "manifest.json").read_text())
    assert "input_range_mb" not in manifest["prep_config"]
    if kind == "text":  # a reused tokenizer sizes the shards from a fixed sample: not the whole file, not the ranges
        reuse = [cfg(f"reuse{w}", w, mb) for w, mb in ((2, 0), (1, 0.004))]
        for c in reuse:
            c.tokenizer.path = str(tmp_path / "whole" / "tokenizer")
        assert _run(monkeypatch, reuse[0])[0] == _run(monkeypatch, reuse[1])[0]

"""The table `prepare` prints at the end: an image corpus counts images, never 'tokens 0' and 'tokens/s 0'."""

from __future__ import annotations

import re

from data_prep.clean import Stats
from data_prep.config import PrepConfig, SourceConfig
from data_prep.summary import build_summary, classes_missing, format_summary, missing_classes_warning


def _summary(kind: str, tokens: int) -> str:
    """The table of a job that read 400 inputs (2 duplicates, 1 unreadable) into 358 + 40 samples in 15 s."""
    src = SourceConfig(type="image_folder" if kind == "images" else "text", paths=["digits"])
    cfg = PrepConfig(kind=kind, output="out", sources=[src], worker_malloc="system")
    stats = Stats({"documents_in": 400, "documents_kept": 398, "removed.exact_duplicate": 2})
    stats.bad("digits/3/0042.png", "unreadable_image")
    shard = {"bytes": 400_000}
    manifest = {"splits": {"train": {"samples": 358, "tokens": tokens, "shards": [shard]},
                           "validation": {"samples": 40, "tokens": 0, "shards": [shard]}}}
    return format_summary(build_summary(cfg, manifest, stats, wall=15.0))


def test_an_image_job_counts_images_and_their_rate():
    rows = {line.rsplit("  ", 1)[0].strip(): line.rsplit("  ", 1)[1].strip() for line in _summary("images", 0).splitlines()
            if "  " in line}
    assert rows["images in"] == "400" and rows["images kept"] == "398" and rows["removed: exact_duplicate"] == "2"
    assert rows["bad records: unreadable_image"] == "1" and rows["images/s"] == "27"  # 398 samples in 15 s
    # under max_bad_fraction the job goes on: the table names the image, not only how many (it named none)
    assert rows["bad records: files"] == "digits/3/0042.png"
    assert not {"tokens", "tokens/s", "documents in", "documents kept"} & rows.keys()


def test_a_text_job_counts_documents_and_tokens():
    table = _summary("packed_lm", 183_296)
    assert "documents in" in table and "documents kept" in table and "183,296" in table and "tokens/s" in table
    assert "images" not in table


def test_bad_records_below_the_threshold_point_at_the_worst_files_first_one(tmp_path):
    """Under max_bad_fraction the job goes on; the table names where to look, not only how many."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "a good document"}\n\n{"text": "another"}\n{"text": "cut short\n{"body": 1}\n')
    cfg = PrepConfig(kind="packed_lm", output="out", sources=[SourceConfig(type="jsonl", paths=[str(docs)])],
                     worker_malloc="system")
    stats = Stats({"documents_in": 2, "documents_kept": 2})
    stats.bad(str(docs), "missing_field", at=("byte", docs.read_text().index('{"body"')))
    stats.bad(str(docs), "bad_json", at=("byte", docs.read_text().index('{"text": "cut')))
    stats.bad("other.jsonl", "bad_json", at=("byte", 0))
    manifest = {"splits": {"train": {"samples": 2, "tokens": 9, "shards": [{"bytes": 10}]}}}
    table = format_summary(build_summary(cfg, manifest, stats, wall=1.0))
    assert re.search(rf"bad records: first in worst file +{re.escape(str(docs))} line 4\n", table), table


def test_classes_a_split_lacks_are_named_per_split_and_shards_of_an_older_prepare_claim_nothing():
    classes = {f"c{k}": k for k in range(12)}
    records = [{"name": "train-000000.tar", "class_counts": {str(k): 3 for k in range(11)}},
               {"name": "validation-000000.tar", "class_counts": {"0": 1, "1": 2}}]
    missing = classes_missing(records, classes)
    assert missing == {"train": ["c11"], "validation": [f"c{k}" for k in range(2, 12)]}
    line = missing_classes_warning({"output": "corpus", "classes_missing": missing})
    assert "no train image of 1 class(es): c11;" in line
    assert "no validation image of 10 class(es): c2, c3, c4, c5, c6, c7, c8, c9, ... (10 in all)" in line
    assert classes_missing([*records, {"name": "train-000001.tar"}], classes) == {}  # no per-class counts recorded
    assert missing_classes_warning({"output": "corpus"}) is None

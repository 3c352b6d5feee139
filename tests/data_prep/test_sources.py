"""Every source type, and bad input: counted per file and rule, or a clear failure."""

from __future__ import annotations

import json

import pytest

from data_prep.config import PrepConfig, SourceConfig, TokenizerConfig
from data_prep.errors import PrepError
from data_prep.job import run_prepare

pytestmark = pytest.mark.slow


def _docs(n: int, prefix: str = "doc") -> list[str]:
    return [f"{prefix} {i}. " + " ".join(f"The quick brown fox number {i} jumps over lazy dog {j}." for j in range(8)) for i in range(n)]


def _cfg(tmp_path, sources, **kw) -> PrepConfig:
    return PrepConfig(kind="packed_lm", output=str(tmp_path / "out"), sources=sources, seq_len=16, progress=False,
                      tokenizer=TokenizerConfig(type="bpe", vocab_size=400), **kw)


def test_bad_records_are_counted_per_file_and_rule(ray_cluster, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"body": d}) for d in _docs(300)) + "\n")
    bad = tmp_path / "bad.jsonl"
    good_first = "".join(json.dumps({"body": d}) + "\n" for d in _docs(2, "first"))
    bad.write_bytes(good_first.encode() + b'{"body": "truncated\n{"other": "no body field"}\n\xff\xfe invalid utf8\n')
    (tmp_path / "empty.jsonl").write_text("")
    src = [SourceConfig(type="jsonl", paths=[str(tmp_path / "*.jsonl")], text_field="body")]
    summary = run_prepare(_cfg(tmp_path, src, max_bad_fraction=0.05))
    assert summary["bad"] == {"bad_json": 1, "empty_file": 1, "invalid_utf8": 1, "missing_field": 1}
    stats = json.loads((tmp_path / "out" / "manifest.json").read_text())["stats"]
    assert stats["bad_by_file"][str(bad)] == {"bad_json": 1, "invalid_utf8": 1, "missing_field": 1}
    with pytest.raises(PrepError, match=r"are bad \(1\.3% > max_bad_fraction=0\.01\)\. Worst files: .*bad\.jsonl: "
                                        r"\{'bad_json': 1, 'invalid_utf8': 1, 'missing_field': 1\} \(the first at line 3\)"):  # 4 bad of 304 > 1 %: the
        # rerun with the default threshold goes on (no shard depends on it) and stops on the bad records
        run_prepare(_cfg(tmp_path, src))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_wrong_text_field_is_named_with_the_fix(ray_cluster, tmp_path):
    """Every record lacked the field: the message said only 'Fix or remove these files', not the config key."""
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"id": i, "text": d}) for i, d in enumerate(_docs(50))) + "\n")
    src = [SourceConfig(type="jsonl", paths=[str(tmp_path / "docs.jsonl")], text_field="body")]
    with pytest.raises(PrepError, match=r"docs.jsonl: \{'missing_field': 50\} \(the first at line 1\)\. missing_field: no string under "
                                        r"text_field=body; .* set sources\[\]\.text_field to it"):
        run_prepare(_cfg(tmp_path, src))
    assert not (tmp_path / "out").exists()

    # with a tokenizer reused (tokenizer.path), no tokenizer sample is read: the error names the sample it read
    run_prepare(_cfg(tmp_path, [SourceConfig(type="jsonl", paths=[str(tmp_path / "docs.jsonl")])]))
    reuse = PrepConfig(kind="packed_lm", output=str(tmp_path / "again"), sources=src, seq_len=16, progress=False,
                       tokenizer=TokenizerConfig(path=str(tmp_path / "out" / "tokenizer")))
    with pytest.raises(PrepError, match=r"input records in the first \d+ bytes read to size the shards are bad"):
        run_prepare(reuse)


def test_missing_path_fails_fast_naming_it(tmp_path):
    with pytest.raises(PrepError, match="nowhere/.*txt"):
        run_prepare(_cfg(tmp_path, [SourceConfig(type="text", paths=[str(tmp_path / "nowhere/*.txt")])]))


def test_parquet_and_hf_sources(ray_cluster, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": _docs(100, "parquet")}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"text": _docs(100, "saved")}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "raw.json").write_text("\n".join(json.dumps({"text": d}) for d in _docs(100, "loaded")))
    sources = [
        SourceConfig(type="parquet", paths=[str(tmp_path / "a.parquet")]),
        SourceConfig(type="hf_disk", paths=[str(tmp_path / "saved")]),
        SourceConfig(type="hf_load", builder="json", paths=[str(tmp_path / "raw.json")]),
    ]
    summary = run_prepare(_cfg(tmp_path, sources))
    assert summary["documents_in"] == 300 and summary["bad"] == {}


def test_cli_exit_codes(tmp_path, capsys):
    from data_prep.__main__ import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"kind: bert_pairs\noutput: {tmp_path / 'o'}\nsources: [{{type: text, paths: [{tmp_path / 'missing.txt'}]}}]\n")
    assert main([str(cfg), "seq_lenn=3"]) == 2
    assert "seq_len" in capsys.readouterr().err
    assert main([str(cfg)]) == 2  # a missing input is the user's to fix too (README Safety: exit 2)
    assert "missing.txt" in capsys.readouterr().err


def test_near_dedup_removes_near_copies(ray_cluster, tmp_path):
    docs = _docs(60)
    near = [d.replace("lazy dog 3.", "sleepy dog 3.") for d in docs[:10]]  # one word changed
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs + near + docs[50:55]))
    cfg = _cfg(tmp_path, [SourceConfig(type="jsonl", paths=[str(tmp_path / "a.jsonl")])])
    cfg.clean.near_dedup = True
    summary = run_prepare(cfg)
    exact, near = summary["removed"].get("exact_duplicate", 0), summary["removed"]["near_duplicate"]
    assert near >= 8 and exact + near >= 13
    assert summary["documents_kept"] == 75 - exact - near

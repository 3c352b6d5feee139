"""Inputs that used to give a traceback or silent damage now give one message naming the file and line."""

from __future__ import annotations

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

"""Inputs as users hand them over: a spreadsheet's image CSV, a Windows-saved JSONL, an output put among the inputs.

Each problem stops `prepare` before Ray starts, with one line (exit 2) naming the file and the fix, and leaves no
output folder behind; what should work (a byte-order mark, CRLF line ends) reads as the plain file does.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.__main__ import main
from data_prep.config import PrepConfig, SourceConfig
from data_prep.errors import PrepError
from data_prep.job import run_prepare
from data_prep.sources import iter_text_records, resolve_inputs


def _digits_csv(root: Path, n: int = 30) -> list[list[str]]:
    """scikit-learn's digits as PNGs under root/img and the rows of a path,label CSV (header first)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    (root / "img").mkdir(parents=True)
    rows = [["path", "label"]]
    for i in range(n):
        Image.fromarray((digits.images[i] * 16).clip(0, 255).astype(np.uint8)).save(root / "img" / f"{i:03d}.png")
        rows.append([f"img/{i:03d}.png", str(digits.target[i])])
    return rows


def _write_csv(path: Path, rows: list[list[str]], encoding: str = "utf-8") -> Path:
    with open(path, "w", newline="", encoding=encoding) as fh:
        csv.writer(fh).writerows(rows)
    return path


def _images_cfg(tmp_path: Path, csv_path: Path) -> PrepConfig:
    return PrepConfig(kind="images", output=str(tmp_path / "out"), progress=False,
                      sources=[SourceConfig(type="image_csv", paths=[str(csv_path)])])


def test_an_empty_label_cell_is_refused_with_its_line(tmp_path):
    """It became a class of its own, named '' (11 classes from the 10 digits), and the job succeeded."""
    rows = _digits_csv(tmp_path)
    rows[5][1] = ""
    cfg = _images_cfg(tmp_path, _write_csv(tmp_path / "labels.csv", rows))
    with pytest.raises(PrepError, match=r"labels\.csv line 6: the 'label' cell of 'img/004\.png' is empty\. "
                                        r"Fill in its class or remove the row\."):
        run_prepare(cfg)
    assert not (tmp_path / "out").exists()


def test_a_path_naming_no_file_is_the_csv_row_to_fix(tmp_path, capsys):
    """It was counted as an unreadable image and the message said to fix the (missing) image file."""
    rows = _digits_csv(tmp_path)
    rows[3][0] = "img/nothere.png"
    cfg_file = tmp_path / "prep.yaml"
    cfg_file.write_text(f"kind: images\noutput: {tmp_path / 'out'}\nprogress: false\n"
                        f"sources: [{{type: image_csv, paths: [{_write_csv(tmp_path / 'labels.csv', rows)}]}}]\n")
    assert main([str(cfg_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "labels.csv line 4: 'path' names 'img/nothere.png', which is no file" in err[0]
    assert "relative to the CSV's folder). Fix the path or remove the row." in err[0]
    assert not (tmp_path / "out").exists()


def test_a_csv_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Excel's "CSV UTF-8" starts with a BOM, which hid the first column: 'has no column(s) ['path']'."""
    rows = _digits_csv(tmp_path)
    plain = resolve_inputs(_images_cfg(tmp_path, _write_csv(tmp_path / "plain.csv", rows)), str(tmp_path))
    bom = resolve_inputs(_images_cfg(tmp_path, _write_csv(tmp_path / "bom.csv", rows, "utf-8-sig")), str(tmp_path))
    assert bom == plain and len(plain[0]) == 30 and len(plain[1]) == 10


def test_jsonl_with_a_byte_order_mark_and_crlf_reads_as_the_plain_file(tmp_path):
    """Notepad's UTF-8 JSONL: the BOM made the first line a bad_json record (1 of 79 pydoc topics: over 1 %)."""
    from pydoc_data.topics import topics

    lines = [json.dumps({"id": k, "text": v}) for k, v in sorted(topics.items())]
    (tmp_path / "plain.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "win.jsonl").write_bytes(b"\xef\xbb\xbf" + ("\r\n".join(lines) + "\r\n").encode())
    src = SourceConfig(type="jsonl", paths=["unused"])
    plain = list(iter_text_records(str(tmp_path / "plain.jsonl"), src))
    win = list(iter_text_records(str(tmp_path / "win.jsonl"), src))
    size = (tmp_path / "win.jsonl").stat().st_size
    assert win == plain and len(plain) == len(topics) and all(rule is None for _, rule, _ in plain)
    assert list(iter_text_records(str(tmp_path / "win.jsonl"), src, [0, size])) == plain  # a range from the start


def test_text_with_a_byte_order_mark_has_no_bom_in_its_first_document(tmp_path):
    for mode in ("paragraphs", "file"):
        (tmp_path / "doc.txt").write_bytes(b"\xef\xbb\xbfFirst paragraph of the file.\r\n\r\nSecond one.\r\n")
        first = next(iter_text_records(str(tmp_path / "doc.txt"), SourceConfig(type="text", paths=["x"], text_mode=mode)))
        assert first[0].startswith("First paragraph"), mode


@pytest.mark.parametrize("pattern", ["texts", "texts/*", "**"])
def test_an_output_among_the_inputs_is_refused(tmp_path, monkeypatch, pattern):
    """output=texts/corpus with paths [texts]: the first run read nothing of it, the rerun read its own shards
    and tokenizer as documents (invalid_utf8 and unreadable_file records) and went on."""
    from pydoc_data.topics import topics

    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    for k, v in sorted(topics.items())[:20]:
        (tmp_path / "texts" / f"{k}.txt").write_text(v)
    cfg = PrepConfig(kind="bert_pairs", output="texts/corpus", progress=False,
                     sources=[SourceConfig(type="text", paths=[pattern])])
    with pytest.raises(PrepError, match=r"output=texts/corpus (lies inside the input directory|is the input) .*"
                                        r"Choose an output folder outside every input path\."):
        run_prepare(cfg)
    assert not (tmp_path / "texts" / "corpus").exists()
    # files of a folder that also holds the output: they are no input directory, so this one is allowed
    assert len(resolve_inputs(PrepConfig(kind="bert_pairs", output="texts/corpus", sources=[
        SourceConfig(type="text", paths=["texts/*.txt"])]), "texts/corpus/.state")[0]) == 20


def test_a_datasetdict_without_the_split_names_its_splits(tmp_path):
    """It said the folder was no save_to_disk dataset at all ('no state.json or dataset_dict.json')."""
    from pydoc_data.topics import topics

    import datasets

    ds = datasets.Dataset.from_dict({"text": sorted(topics.values())})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "saved"))
    for split, fine in (("", True), ("test", True), ("validation", False)):
        cfg = PrepConfig(kind="bert_pairs", output=str(tmp_path / "out"),
                         sources=[SourceConfig(type="hf_disk", paths=[str(tmp_path / "saved")], split=split)])
        if fine:
            assert len(resolve_inputs(cfg, str(tmp_path))[0]) == 1
            continue
        with pytest.raises(PrepError, match=r"saved is a DatasetDict with the splits \['train', 'test'\] "
                                            r"\(dataset_dict.json\), none named 'validation'\. Set `split`"):
            resolve_inputs(cfg, str(tmp_path))

"""Reading labelled examples: formats, label sets, bad rows counted with file and line."""

import json

import pytest

from pipelines.finetune.data import FinetuneError, collate_classification, read_examples


def write_tsv(path, rows):
    path.write_text("\n".join("\t".join(r) for r in rows) + "\n")
    return path


def test_tsv_label_set_is_sorted_and_shared(tmp_path):
    train = write_tsv(tmp_path / "train.tsv", [("text", "label"), ("a b", "pos"), ("c d", "neg"), ("e", "pos")])
    examples, labels, report = read_examples(train, text_column="text", label_column="label")
    assert labels == ["neg", "pos"] and [e.label for e in examples] == [1, 0, 1]
    val = write_tsv(tmp_path / "val.tsv", [("text", "label"), ("x", "neg")])
    val_examples, _, _ = read_examples(val, text_column="text", label_column="label", label_names=labels)
    assert val_examples[0].label == 0


def test_bad_rows_are_counted_then_fail_over_threshold(tmp_path):
    rows = [("text", "label")] + [(f"doc {i}", "a") for i in range(200)] + [("", "a"), ("odd", "zzz")]
    path = write_tsv(tmp_path / "train.tsv", rows)
    examples, _, report = read_examples(
        path, text_column="text", label_column="label", label_names=["a"], max_bad_share=0.02
    )
    assert len(examples) == 200
    assert report.bad == {"empty text": 1, "label not in the label set": 1}
    assert f"{path}:203" in report.first_bad["label not in the label set"]
    with pytest.raises(FinetuneError, match=r"over the limit of 0\.5%"):
        read_examples(path, text_column="text", label_column="label", label_names=["a"], max_bad_share=0.005)


def test_jsonl_pairs_and_broken_line(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [json.dumps({"q": f"q{i}", "p": f"p{i}", "y": i % 2}) for i in range(300)] + ['{"q": "trunc']
    path.write_text("\n".join(lines) + "\n")
    examples, labels, report = read_examples(path, text_column="q", text_pair_column="p", label_column="y")
    assert labels == ["0", "1"] and examples[1].text_pair == "p1"
    assert report.bad == {"not valid JSON": 1} and report.first_bad["not valid JSON"] == f"{path}:301"


def test_wrong_column_names_and_missing_file(tmp_path):
    path = write_tsv(tmp_path / "train.tsv", [("sentence", "y"), ("a", "1")])
    with pytest.raises(FinetuneError, match="data.text_column"):
        read_examples(path, text_column="text", label_column="label")
    with pytest.raises(FinetuneError, match="does not exist"):
        read_examples(tmp_path / "nope.tsv", text_column="text", label_column="label")


def test_a_directory_given_for_a_data_file_is_called_a_directory(tmp_path):
    """data.train=<the task folder>: it exists, so 'does not exist' sent users looking in the wrong place."""
    from pipelines.finetune.squad import read_squad

    with pytest.raises(FinetuneError, match=f"{tmp_path} is a directory, not a file"):
        read_examples(tmp_path, text_column="text", label_column="label")
    with pytest.raises(FinetuneError, match=f"{tmp_path} is a directory, not a file"):
        read_squad(tmp_path)


def test_regression_labels_and_collate(tmp_path):
    path = write_tsv(tmp_path / "train.tsv", [("text", "score"), ("a", "0.5"), ("b", "2")])
    examples, labels, _ = read_examples(path, text_column="text", label_column="score", regression=True)
    assert labels == ["score"] and [e.label for e in examples] == [0.5, 2.0]
    batch = collate_classification(
        [{"input_ids": [2, 5, 3], "token_type_ids": [0, 0, 0], "label": 0.5},
         {"input_ids": [2, 3], "token_type_ids": [0, 0], "label": 2.0}],
        pad_id=0,
    )
    assert batch["input_ids"].tolist() == [[2, 5, 3], [2, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].dtype.is_floating_point


def test_a_label_column_of_one_value_is_refused_naming_file_and_column(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("text\ttopic\n" + "".join(f"row {i}\tsports\n" for i in range(30)))
    with pytest.raises(FinetuneError, match=r"train.tsv: column 'topic' holds one value \('sports'\).*data.label_column"):
        read_examples(path, text_column="text", label_column="topic")


def test_a_csv_row_is_placed_at_its_first_line_and_an_unclosed_quote_is_named(tmp_path):
    """Quoted cells with line breaks and tabs are legal; a bad record was placed at its last line, which for an
    unclosed quote is the end of the file (it takes in every line after it): nowhere near the quote."""
    import csv

    path = tmp_path / "train.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        writer.writerows([(f"line one of {i}\n\tline two, with a tab", "ab"[i % 2]) for i in range(150)])
        fh.write('"an unclosed quote,a\n' + "".join(f"doc {i},b\n" for i in range(5)))
    examples, labels, report = read_examples(path, text_column="text", label_column="label", max_bad_share=0.01)
    assert len(examples) == 150 and labels == ["a", "b"] and examples[0].text == "line one of 0\n\tline two, with a tab"
    assert report.bad == {"missing field": 1}
    assert report.first_bad["missing field"] == f"{path}:302 (a quoted cell runs on to line 307: an unclosed quote?)"


def test_the_columns_the_file_has_and_the_unknown_label_are_named(tmp_path):
    """'no row has all of the columns' and 'label not in the label set' left the user to find out what the
    file has: its columns, and the label (a JSON 1.0 is not the training file's 1) next to the known ones."""
    path = write_tsv(tmp_path / "train.tsv", [("sentence", "y"), ("a", "1")])
    with pytest.raises(FinetuneError, match=r"\(the file has \['sentence', 'y'\]; the first row without them at "
                                            rf"{path}:2\)"):
        read_examples(path, text_column="text", label_column="label")
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"text": f"t{i}", "label": [0, 1.0][i % 2]}) + "\n" for i in range(4)))
    with pytest.raises(FinetuneError, match=rf"2 label not in the label set \(first at {dev}:2, label '1.0'; the "
                                            r"training file's labels: '0', '1'\)"):
        read_examples(dev, text_column="text", label_column="label", label_names=["0", "1"])


def test_a_byte_order_mark_is_not_part_of_the_first_column_and_the_share_over_the_limit_shows(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark: the first column was read as '\\ufefftext' and the file
    refused for lacking a 'text' column (a JSONL file lost its first line as 'not valid JSON'). And 1 bad row of 99
    was '1.0% of the file, over the limit of 1.0%'."""
    from pipelines.finetune.squad import read_squad

    rows = "".join(f"doc {i},{'ab'[i % 2]}\n" for i in range(98))
    (tmp_path / "train.csv").write_bytes(b"\xef\xbb\xbf" + f"text,label\n{rows}".encode())
    examples, labels, _ = read_examples(tmp_path / "train.csv", text_column="text", label_column="label")
    assert len(examples) == 98 and labels == ["a", "b"]
    lines = [json.dumps({"text": f"doc {i}", "label": "ab"[i % 2]}) for i in range(98)] + ['{"text": "x", "label": "c"}']
    (tmp_path / "dev.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    with pytest.raises(FinetuneError, match=r"1 skipped: 1 label not in .* That is 1\.01% of the file, over the limit "
                                            r"of 1\.0%"):
        read_examples(tmp_path / "dev.jsonl", text_column="text", label_column="label", label_names=labels)
    squad = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "The cat sat.", "qas": [
        {"id": "q1", "question": "Who sat?", "answers": [{"text": "The cat", "answer_start": 0}]}]}]}]}
    (tmp_path / "dev.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(squad).encode())
    assert [e.qid for e in read_squad(tmp_path / "dev.json")[0]] == ["q1"]

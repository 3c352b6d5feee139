"""`pretrain inspect`: a damaged corpus (tokenizer, shard cut short, zero-filled or deleted, a file that is no
shard) is one paragraph naming the file and the fix, exit 2 — never a traceback or a wrong sample count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))

import corpus_fixtures as cf  # noqa: E402

from pipelines.cli import main  # noqa: E402


@pytest.fixture
def corpus(tmp_path) -> Path:
    return cf.make_bert_corpus(tmp_path / "corpus", train_sizes=(24, 16), val_sizes=(8,))


def _inspect(path: Path, capsys) -> tuple[int, str, str]:
    code = main(["inspect", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def _one_paragraph(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_an_intact_corpus_and_one_of_its_shards_are_shown(corpus, capsys):
    code, out, err = _inspect(corpus, capsys)
    assert code == 0 and "bert_pairs" in out and "train-000000.tar: 24 samples" in out and "A: " in out, err
    code, out, err = _inspect(corpus / "train-000001.tar", capsys)
    assert code == 0 and "train-000001.tar: 16 samples" in out, err


def test_a_damaged_tokenizer_is_named(corpus, capsys):
    tok = corpus / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:300])  # a copy cut short: `EOF while parsing` from the tokenizers library
    code, _, err = _inspect(corpus, capsys)
    line = _one_paragraph(err)
    assert code == 2 and str(tok) in line and "re-run `pretrain prepare`" in line


@pytest.mark.parametrize("damage", ["truncated", "zero-filled", "deleted"])
def test_a_damaged_shard_is_reported_not_counted(corpus, damage, capsys):
    """A shard cut short or missing, anywhere in the corpus: a stat says so. Same-size damage shows in the
    sha256, which inspect takes of the shard it shows (the first, or the one named), not the whole corpus."""
    shard = corpus / ("train-000000.tar" if damage == "zero-filled" else "train-000001.tar")
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[:3000])
    elif damage == "zero-filled":  # reads as an empty tar: "0 samples" before
        shard.write_bytes(bytes(len(data)))
    else:
        shard.unlink()
    for target in (corpus, shard) if damage != "deleted" else (corpus,):
        code, out, err = _inspect(target, capsys)
        line = _one_paragraph(err)
        assert code == 2 and str(shard) in line and "manifest.json" in line and "pretrain prepare" in line, line
        assert "samples" not in out


def test_a_file_that_is_no_shard_is_named(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a tar file\n" * 100)
    code, _, err = _inspect(text, capsys)
    line = _one_paragraph(err)
    assert code == 2 and f"{text} is not a readable shard" in line and "corpus directory" in line


def test_a_missing_path_exits_2(tmp_path, capsys):
    code, _, err = _inspect(tmp_path / "typo", capsys)
    assert code == 2 and f"{tmp_path / 'typo'} does not exist" in _one_paragraph(err)


def test_an_image_corpus_shows_no_seq_len_tokens_or_nsp_counts(tmp_path, capsys):
    """An images corpus read 'seq_len None', '0 tokens' per split and 'nsp_random=0' among its cleaning counts."""
    import json

    for make, kind in ((cf.make_image_corpus, "images"), (cf.make_gpt_corpus, "packed_lm")):
        root = make(tmp_path / kind)
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["stats"] = {"counts": {"documents_in": 120, "documents_kept": 120, "nsp_random": 0}}  # as prepare writes
        (root / "manifest.json").write_text(json.dumps(manifest))
        code, out, err = _inspect(root, capsys)
        head = "\n".join(out.splitlines()[:5])
        assert code == 0 and "nsp_random" not in head and "cleaning: documents_in=120, documents_kept=120" in head, err
        if kind == "images":
            assert "seq_len" not in head and "tokens" not in head and "train       2 shards  88 samples  " in head
        else:
            assert "seq_len 32" in head and " tokens  " in head


def test_inspect_into_head_ends_without_a_traceback(tmp_path):
    """`pretrain inspect CORPUS | head -3` printed a BrokenPipeError traceback after the three lines."""
    import os
    import subprocess

    root = cf.make_gpt_corpus(tmp_path / "corpus", train_sizes=(400,), val_sizes=(8,))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = f"{sys.executable} -m pipelines.cli inspect {root} -n 400 | head -3"
    run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert len(run.stdout.splitlines()) == 3 and run.stdout.startswith("corpus ")
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr

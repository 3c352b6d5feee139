"""`prepare` into an existing output: the same config resumes it byte for byte, another config is refused naming
what differs (``overwrite=true`` replaces only prepare's files), and a prepare stopped by bad input takes back
the directory it created (no empty, marked folder; no copied tokenizer)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from core.files import MARKER
from pipelines.cli import main

REPO = Path(__file__).resolve().parents[2]


def _texts(root: Path) -> str:
    """Python's own pydoc topics as a few text files of blank-line-separated paragraphs (real text, always installed)."""
    from pydoc_data.topics import topics

    root.mkdir(parents=True, exist_ok=True)
    items = sorted(topics.items())[:60]
    for i in range(0, len(items), 10):
        (root / f"topics-{i:03d}.txt").write_text("\n\n".join(v for _, v in items[i: i + 10]), encoding="utf-8")
    return str(root / "*.txt")


def _files(corpus: Path) -> dict[str, str]:
    return {str(p.relative_to(corpus)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(corpus.rglob("*")) if p.is_file()}


def _prepare(capsys, *args: str) -> tuple[int, str]:
    code = main(["prepare", *args, "progress=false"])
    return code, capsys.readouterr().err


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow
def test_same_config_resumes_another_is_refused_overwrite_replaces(ray_cluster, tmp_path, capsys):
    sources = f"sources=[{{type: text, paths: ['{_texts(tmp_path / 'raw')}']}}]"
    out = tmp_path / "corpus"
    bert = ["configs/data/demo_bert.yaml", f"output={out}", sources]
    assert _prepare(capsys, *bert)[0] == 0
    built = _files(out)
    assert _prepare(capsys, *bert, "num_workers=1")[0] == 0  # the same config (workers do not count): resumed
    assert _files(out) == built

    gpt = ["configs/data/gpt_packed.yaml", f"output={out}", "seq_len=128", sources]
    code, err = _prepare(capsys, *gpt)
    line = _error_line(err)
    assert code == 2 and f"output={out} holds a finished corpus" in line and "kind: 'bert_pairs' -> 'packed_lm'" in line
    assert "another output folder" in line and "overwrite=true" in line
    assert _files(out) == built  # nothing touched

    (out / "manifest.json").unlink()  # as a prepare killed after it removed the manifest: a partial corpus
    code, err = _prepare(capsys, *gpt)
    assert code == 2 and "holds a partly written corpus" in _error_line(err)

    (out / "notes.txt").write_text("mine")  # not prepare's: overwrite keeps it
    assert _prepare(capsys, *gpt, "overwrite=true")[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "packed_lm" and (out / "notes.txt").read_text() == "mine"
    assert set(_files(out)) >= {"manifest.json", "tokenizer/tokenizer.json"}


def _bpe_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style: no [CLS]/[SEP]), saved as tokenizers saves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.mark.parametrize("bad", ["no input", "damaged tokenizer", "BPE tokenizer for bert_pairs"])
@pytest.mark.parametrize("where", ["new", "empty folder of yours"])
def test_a_prepare_stopped_by_bad_input_leaves_nothing_behind(bad, where, tmp_path, capsys):
    raw = _texts(tmp_path / "raw")
    out = tmp_path / "new" / "corpus" if where == "new" else tmp_path / "mine"
    if where != "new":
        out.mkdir()
    args = ["configs/data/demo_bert.yaml", f"output={out}", f"sources=[{{type: text, paths: ['{raw}']}}]"]
    if bad == "no input":
        args[-1] = f"sources=[{{type: text, paths: ['{tmp_path / 'typo'}/*.txt']}}]"
        named = tmp_path / "typo"
    elif bad == "damaged tokenizer":
        tok = _bpe_tokenizer(tmp_path / "tok")
        (tok / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes()[:300])  # EOF while parsing
        args.append(f"tokenizer.path={tok}")
        named = tok / "tokenizer.json"
    else:
        args.append(f"tokenizer.path={_bpe_tokenizer(tmp_path / 'tok')}")
        named = tmp_path / "tok"
    code, err = _prepare(capsys, *args)
    line = _error_line(err)
    assert code == 2 and str(named) in line, line
    assert str(out / "tokenizer") not in line  # the user's path, not a copy prepare made of it
    if where == "new":
        assert not (tmp_path / "new").exists()
    else:
        assert out.is_dir() and not any(out.iterdir()) and not (out / MARKER).exists()

"""Weighted corpus mixtures (``data.corpora``): realised shares, determinism, exact resume on any world
size, refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import corpus_fixtures as cf
import pytest
from job_helpers import read_trace, run_pretrain, summary_of

from core.corpus import DataError, load_manifest
from core.files import sha256_file
from pipelines.engine import objectives as tasks
from pipelines.engine.config import RunConfig
from pipelines.loading.blend import SlotCursor, check_blendable
from pipelines.loading.loader import StreamingSource


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("blend")
    return {  # a small corpus (repeated many times over) and a big one (never exhausted), same tokenizer
        "small": cf.make_gpt_corpus(root / "small", train_sizes=(150, 133), val_sizes=(16,), seed=1),
        "big": cf.make_gpt_corpus(root / "big", train_sizes=(4000, 3500, 2600), val_sizes=(16,), seed=2),
    }


def _blend(corpora, weights, *, workers=0, mb=32, seed=0, rank=0, world=1):
    mixture = [(name, w, load_manifest(corpora[name])) for name, w in weights.items()]
    cfg = RunConfig()
    cfg.train.task = "causal_lm"
    return StreamingSource(mixture, "train", tasks.build_task(cfg, mixture[0][2]).collate, micro_batch_size=mb, rank=rank,
                           world=world, num_workers=workers, shuffle_buffer=64, seed=seed)


def _keys(src, n):
    return [k for b in src.batches(limit=n) for k in b["keys"]]


def test_the_schedule_keeps_every_corpus_within_one_sample_of_its_share():
    weights = [0.2, 0.5, 0.3]
    picks = SlotCursor(weights).take(0, 10_000)
    running = [0, 0, 0]
    for q, (i, k) in enumerate(picks, start=1):
        assert k == running[i]  # the next sample of that corpus
        running[i] += 1
        assert all(abs(running[j] - weights[j] * q) < 1 for j in range(3)), q
    skipping = SlotCursor(weights)
    assert skipping.take(4000, 10) == picks[4000:4010]  # a rank or worker skips other slots and agrees


def test_shares_over_10k_samples_a_small_corpus_repeats_a_big_one_is_not_exhausted(corpora):
    src = _blend(corpora, {"small": 0.3, "big": 0.7})
    keys = _keys(src, 313)  # 10,016 samples
    share = Counter(k.split("/")[0] for k in keys)
    assert abs(share["small"] / len(keys) - 0.3) < 0.01 and abs(share["big"] / len(keys) - 0.7) < 0.01
    small = [k for k in keys if k.startswith("small/")]
    per_epoch = 150 + 133  # epochs follow each other without a dropped tail
    assert len(small) > 10 * per_epoch  # repeated ten times over ...
    assert len(set(small[:per_epoch])) == per_epoch  # ... each epoch a permutation of distinct samples
    assert small[:per_epoch] != small[per_epoch:2 * per_epoch]  # in a new order
    big = [k for k in keys if k.startswith("big/")]
    assert len(set(big)) == len(big)  # 7,000 of 10,100: nothing read twice
    state = src.state_dict()
    assert state["consumed"] == {"small": share["small"], "big": share["big"]} and state["position"] == 10_016
    assert state["corpus_epochs"]["small"] > 10 and state["corpus_epochs"]["big"] < 1


def test_same_seed_same_sequence_whatever_the_workers_and_ranks(corpora):
    a = _keys(_blend(corpora, {"small": 0.5, "big": 0.5}), 20)
    assert a == _keys(_blend(corpora, {"small": 0.5, "big": 0.5}, workers=2), 20)
    assert a != _keys(_blend(corpora, {"small": 0.5, "big": 0.5}, seed=1), 20)
    ranks = [_blend(corpora, {"small": 0.5, "big": 0.5}, mb=16, rank=r, world=2, workers=2).batches(limit=20) for r in range(2)]
    assert a == [k for b0, b1 in zip(*ranks, strict=True) for k in [*b0["keys"], *b1["keys"]]]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_mixture_goes_on_with_the_next_sample_of_every_corpus(corpora, workers):
    weights = {"small": 0.37, "big": 0.63}
    full = _keys(_blend(corpora, weights, workers=workers), 30)
    first = _blend(corpora, weights, workers=workers)
    head = _keys(first, 11)
    state = json.loads(json.dumps(first.state_dict()))  # as written to the checkpoint
    assert state["consumed"]["small"] % 32 and state["consumed"]["big"] % 32  # corpora stopped inside a window
    resumed = _blend(corpora, weights, workers=workers)
    resumed.load_state_dict(state)
    assert head + _keys(resumed, 19) == full
    on_two = [_blend(corpora, weights, mb=16, rank=r, world=2, workers=workers) for r in range(2)]
    for src in on_two:
        src.load_state_dict(state)
    tail = [k for b0, b1 in zip(*(s.batches(limit=19) for s in on_two), strict=True) for k in [*b0["keys"], *b1["keys"]]]
    assert head + tail == full  # and on another world size, same global batch


def test_changed_weights_hold_from_the_resume_point(corpora, caplog):
    first = _blend(corpora, {"small": 0.5, "big": 0.5})
    _keys(first, 10)
    resumed = _blend(corpora, {"small": 0.1, "big": 0.9})
    resumed.load_state_dict(first.state_dict())
    share = Counter(k.split("/")[0] for k in _keys(resumed, 20))
    assert share["small"] == 64  # 10 % of 640 from here on: no burst paying back the old mixture
    assert "mixture changed" in caplog.text


def test_corpora_prepared_differently_are_refused(corpora, tmp_path):
    other_len = cf.make_gpt_corpus(tmp_path / "len", seq_len=16)
    with pytest.raises(DataError, match="sequence length.*tokenizer.path="):
        check_blendable([load_manifest(corpora["small"]), load_manifest(other_len)], ["small", "len"])
    other_tok = cf.make_gpt_corpus(tmp_path / "tok")
    tok = other_tok / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace("river", "rivers"))
    raw = json.loads((other_tok / "manifest.json").read_text())
    raw["tokenizer"]["sha256"] = sha256_file(tok)
    (other_tok / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"corpus 'tok' .* another tokenizer"):
        check_blendable([load_manifest(corpora["small"]), load_manifest(other_tok)], ["small", "tok"])


@pytest.mark.slow
def test_a_mixture_trains_logs_per_corpus_samples_and_resumes_exactly(corpora, tmp_path):
    """The real entry point: 6 steps straight vs 3 + resume + 3, same keys and bitwise losses per step."""
    mix = f"[{{path: {corpora['small']}, weight: 0.25}}, {{path: {corpora['big']}, weight: 0.75}}]"

    def overrides(run_dir, steps):
        return [f"data.corpora={mix}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", "train.checkpoint_every=3",
                "data.micro_batch_size=8", "data.num_workers=2", "data.shuffle_buffer=16", "train.deterministic=true",
                "train.eval_every=0", "train.eval_batches=2", "train.log_every=1", "model.name=gpt-tiny"]

    config = "configs/train/gpt_tiny_cpu.yaml"
    summary_of(run_pretrain(config, overrides(tmp_path / "ref", 6), trace_dir=tmp_path / "t-ref"))
    summary_of(run_pretrain(config, overrides(tmp_path / "run", 3), trace_dir=tmp_path / "t-run"))
    resumed = summary_of(run_pretrain(config, overrides(tmp_path / "run", 6), trace_dir=tmp_path / "t-run"))
    assert resumed["resumed_from"]
    ref, got = read_trace(tmp_path / "t-ref", 0), read_trace(tmp_path / "t-run", 0)
    assert sorted(ref) == sorted(got) == list(range(1, 7))
    for step in ref:
        assert got[step]["keys"] == ref[step]["keys"] and got[step]["loss"] == ref[step]["loss"], step
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in logged if r.get("split") == "train" and "samples/small" in r][-1]
    assert last["samples/small"] + last["samples/big"] == 6 * 8 and last["samples/small"] == 12

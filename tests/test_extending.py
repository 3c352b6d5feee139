"""Adding a model family from outside the product: one spec, one module, one registration (issue #32).

A tiny MLP language model over ``packed_lm`` corpora is defined here, not in ``models/``, registered
with ``models.registered_family`` for the length of a fixture, and taken through what a user does
with a family: the torch-free pre-launch ``check``, a real 2-step training (``trainer.train``, DDP
engine, one in-process CPU rank, on the tiny GPT corpus of ``tests/pipelines/corpus_fixtures.py``)
and ``pretrain export``, which its spec declares it does not support (no ``hf_model_type``): the
export refuses with one clear error and writes nothing. After the fixture nothing of it is left in
either registry. A toy corpus kind does the same for ``core.records`` and the loader's decoding.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import models
from core.config import ConfigError
from core.corpus_kinds import CorpusKind, registered_corpus_kind
from core.families import FamilySpec, families_for_task, family_of_model, list_families
from core.records import npy_bytes
from pipelines.engine.check import check
from pipelines.engine.config import load_run_config

sys.path.insert(0, str(Path(__file__).parent / "pipelines"))

import corpus_fixtures as cf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ---- the toy family: everything a contributor writes ------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class MLPLMConfig:
    """A next-token MLP over the current token's embedding (no attention: the smallest causal LM)."""

    vocab_size: int = 64
    hidden_size: int = 16
    intermediate_size: int = 32
    max_position_embeddings: int = 64


def mlp_lm_flops(config: MLPLMConfig, seq_len: int, include_head: bool = True, mlm_fraction: float = 1.0) -> float:
    """6 N per token: the MLP (2 d d_ff) and the output projection (d V)."""
    d = config.hidden_size
    return 6.0 * (2 * d * config.intermediate_size + (d * config.vocab_size if include_head else 0))


class MLPLM(nn.Module):
    config_class = MLPLMConfig
    family = "mlp_lm"

    def __init__(self, config: MLPLMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids)
        logits = self.head(h + self.mlp(h))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return out


SPEC = FamilySpec(name="mlp_lm", config_class=MLPLMConfig, sizes={"mlp-lm-tiny": {"hidden_size": 16}},
                  tasks=("causal_lm",), corpus_kind="packed_lm", flops=mlp_lm_flops, hf_model_type=None)


@pytest.fixture
def toy_family():
    with models.registered_family(SPEC, MLPLM) as spec:  # the one registration
        yield spec


# ---- what a user does with it ------------------------------------------------------------------------------------


def _config(tmp_path: Path, corpus: Path, *overrides: str):
    return load_run_config(str(REPO / "configs/train/gpt_tiny_cpu.yaml"), [
        "model.name=mlp-lm-tiny", f"data.corpus={corpus}", f"train.run_dir={tmp_path / 'run'}", "train.max_steps=2",
        "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=2", "train.log_every=1",
        "data.micro_batch_size=4", "data.num_workers=0", "distributed.engine=ddp", "schedule.warmup_steps=1", *overrides,
    ])


def test_a_registered_family_is_checked_from_its_spec(toy_family, tmp_path):
    assert "mlp_lm" in list_families() and "mlp-lm-tiny" in models.list_models()
    assert family_of_model("mlp-lm-tiny") is toy_family and toy_family in families_for_task("causal_lm")
    check(_config(tmp_path, tmp_path / "corpus"))  # torch-free: the spec alone answers
    with pytest.raises(ConfigError, match=r"train.task=mlm_nsp needs a bert model but model.name=mlp-lm-tiny is a "
                                          r"mlp_lm model"):
        check(_config(tmp_path, tmp_path / "corpus", "train.task=mlm_nsp"))
    with pytest.raises(ConfigError, match=r"Did you mean `mlp-lm-tiny`"):
        check(_config(tmp_path, tmp_path / "corpus", "model.name=mlp-lm-tiyn"))


def test_a_registered_family_trains_two_steps_and_refuses_export(toy_family, tmp_path):
    from pipelines.engine.distributed import in_process_run
    from pipelines.engine.export import export_checkpoint
    from pipelines.engine.trainer import train

    corpus = cf.make_gpt_corpus(tmp_path / "corpus", train_sizes=(16,), val_sizes=(8,), seq_len=16)
    with in_process_run():
        summary = train(_config(tmp_path, corpus))
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r.get("split", "train") == "train" and "loss" in r]
    assert len(train_losses) == 2 and all(torch.isfinite(torch.tensor(train_losses)))
    state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
    assert state["model_build"]["name"] == "mlp-lm-tiny"
    # the data fixed the vocabulary (causal_lm's model_overrides); MFU counts the FLOPs formula of the spec
    vocab = json.loads((corpus / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    assert state["model_build"]["overrides"]["vocab_size"] == vocab
    per_token = mlp_lm_flops(MLPLMConfig(hidden_size=16, vocab_size=vocab), 16)
    assert records[0]["step_flops"] == pytest.approx(4 * 16 * per_token) and records[0]["mfu"] > 0

    with pytest.raises(ConfigError, match=r"family `mlp_lm`, whose spec declares no Hugging Face mapping"):
        export_checkpoint(summary["checkpoint"], tmp_path / "release")
    assert not (tmp_path / "release").exists()


def test_nothing_of_a_family_outlives_its_registration(tmp_path):
    with models.registered_family(SPEC, MLPLM):
        assert "mlp-lm-tiny" in models.list_models()
    assert "mlp_lm" not in list_families() and "mlp-lm-tiny" not in models.list_models()
    with pytest.raises(ConfigError, match="unknown model `mlp-lm-tiny`"):
        check(_config(tmp_path, tmp_path / "corpus"))
    with pytest.raises(TypeError, match="must set config_class"):  # a half-made registration leaves nothing behind
        models.register_family(dataclasses.replace(SPEC, name="other"), MLPLM)
    assert "other" not in list_families()


def test_a_family_an_optimizer_and_a_sink_from_outside_run_together(toy_family, tmp_path):
    """The acceptance of #32 in one run: three registrations from this module, no product edit."""
    from monitoring.sink import SINKS, register_sink
    from pipelines.engine.distributed import in_process_run
    from pipelines.engine.export import export_checkpoint
    from pipelines.engine.registries import OPTIMIZERS, register_optimizer
    from pipelines.engine.trainer import train

    steps_taken, seen = [], []

    class StepCountingSGD(torch.optim.SGD):
        def step(self, closure=None):
            steps_taken.append(1)
            return super().step(closure)

    class RecordingSink:
        def __init__(self, ctx):
            self.run_dir = ctx.run_dir

        def log(self, step, split, values, scalars):
            seen.append((step, split, values.get("loss")))

        def event(self, step, kind, message, fields):
            pass

        def close(self):
            seen.append(("closed", self.run_dir, None))

    corpus = cf.make_gpt_corpus(tmp_path / "corpus", train_sizes=(16,), val_sizes=(8,), seq_len=16)
    with OPTIMIZERS.restored(), SINKS.restored():
        register_optimizer("counting_sgd", state_tensors=0)(lambda groups, cfg, offload, device:
                                                            StepCountingSGD(groups, lr=cfg.lr))
        register_sink("recording")(RecordingSink)
        cfg = _config(tmp_path, corpus, "optim.name=counting_sgd", "optim.lr=0.1", "logging.sinks=[recording]")
        check(cfg)
        with in_process_run():
            summary = train(cfg)
    assert summary["steps"] == 2 and len(steps_taken) == 2
    assert [step for step, split, _ in seen if split == "train"] == [1, 2]
    assert all(isinstance(loss, float) for _, split, loss in seen if split == "train")
    assert seen[-1] == ("closed", tmp_path / "run", None)
    with pytest.raises(ConfigError, match=r"declares no Hugging Face mapping"):
        export_checkpoint(summary["checkpoint"], tmp_path / "release")


# ---- a corpus kind: one class, one registration; records and the loader's decoding need no edit -------------------


class RaggedLM(CorpusKind):
    """Documents of any length, one after the other, with a ``lengths`` array (no packing, no pairs)."""

    name = "ragged_lm"
    record_arrays = frozenset({"input_ids", "lengths"})

    def sample_tokens(self, sample):
        return len(sample)

    def encode(self, batch, *, seq_len, token_dtype):
        return {"input_ids": np.concatenate(batch).astype(token_dtype), "lengths": np.array([len(b) for b in batch], "<u4")}

    def bounds(self, arrays):
        lengths = arrays["lengths"].astype(np.int64)
        if int(lengths.sum()) != len(arrays["input_ids"]):
            raise ValueError(f"lengths sum to {int(lengths.sum())}, the record holds {len(arrays['input_ids'])} tokens")
        return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths


def test_a_registered_corpus_kind_round_trips_through_records_and_the_loader_decoder():
    from core.records import decode_record, expand_record, token_records
    from pipelines.loading.shard_io import Decoded, decode_sample

    docs = [np.arange(n, dtype=np.int64) + 5 for n in (3, 7, 1, 4)]
    with registered_corpus_kind(RaggedLM()):
        (key, members, n), *rest = list(token_records("ragged_lm", docs, "train-000000", seq_len=8, token_dtype="<u2"))
        assert not rest and n == 4 and set(members) == {"input_ids.npy", "lengths.npy"}
        samples = decode_record("ragged_lm", key, members, max_tokens=5)
        assert [s["input_ids"].tolist() for s in samples] == [d.tolist() for d in docs]
        assert "error" in samples[1] and "7 tokens" in samples[1]["error"]  # over max_tokens: a bad sample, named
        assert decode_sample("ragged_lm", samples[0]["key"], Decoded(samples[0]))["input_ids"].tolist() == [5, 6, 7]
        assert [k for k, _ in expand_record(key, members)] == [f"{key}-{i:05d}" for i in range(4)]
        bad = {**members, "lengths.npy": npy_bytes(np.array([3, 7, 1, 5], "<u4"))}
        with pytest.raises(ValueError, match="lengths sum to 16"):
            decode_record("ragged_lm", key, bad)
    with pytest.raises(ValueError, match="Unknown corpus kind 'ragged_lm'"):
        decode_record("ragged_lm", key, members)

"""A contributor's extension, from outside the product: a toy optimizer and a toy metrics sink, one
registration each, go through `check` and a real 2-step training with no edit to product code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, load_config
from monitoring.sink import SINKS, Sink, SinkContext, register_sink
from pipelines.engine.config import RunConfig
from pipelines.engine.registries import OPTIMIZERS, register_optimizer

sys.path.insert(0, str(Path(__file__).parent / "pipelines"))
import corpus_fixtures as cf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class CountingSGD(torch.optim.SGD):
    """Plain SGD that records each step it takes."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


class ListSink(Sink):
    """Keeps every record it is sent."""

    def __init__(self, ctx: SinkContext) -> None:
        self.run_dir = ctx.run_dir
        self.records: list[tuple[int, str, dict]] = []
        self.events: list[str] = []
        self.closed = False

    def log(self, step, split, values, scalars):
        self.records.append((step, split, dict(values)))

    def event(self, step, kind, message, fields):
        self.events.append(kind)

    def close(self):
        self.closed = True


@pytest.fixture
def toys():
    """The two registrations, undone afterwards so no other test sees them."""
    made: dict[str, list] = {"optimizers": [], "sinks": []}
    with OPTIMIZERS.restored(), SINKS.restored():

        @register_optimizer("toy_sgd", state_tensors=0)
        def _toy_sgd(groups, cfg, offload, device):
            made["optimizers"].append(CountingSGD(groups, lr=cfg.lr))
            return made["optimizers"][-1]

        @register_sink("toy_list")
        def _toy_list(ctx):
            made["sinks"].append(ListSink(ctx))
            return made["sinks"][-1]

        yield made
    assert "toy_sgd" not in OPTIMIZERS and "toy_list" not in SINKS


def _config(tmp_path: Path, corpus: Path, *extra: str) -> RunConfig:
    return load_config(REPO / "configs/train/bert_tiny_cpu.yaml", [
        f"data.corpus={corpus}", f"train.run_dir={tmp_path / 'run'}", "train.max_steps=2", "train.log_every=1",
        "train.eval_every=0", "train.checkpoint_every=0", "data.micro_batch_size=4", "data.num_workers=0",
        "data.shuffle_buffer=16", "distributed.engine=ddp", "logging.tensorboard=false", "optim.lr=0.05",
        "optim.name=toy_sgd", "logging.sinks=[toy_list]", *extra], cls=RunConfig)


def test_a_registered_optimizer_and_sink_run_through_check_and_training(toys, tmp_path):
    from pipelines.engine.check import check
    from pipelines.engine.distributed import in_process_run
    from pipelines.engine.trainer import train

    corpus = cf.make_bert_corpus(tmp_path / "corpus")
    cfg = _config(tmp_path, corpus)
    check(cfg)
    with in_process_run():
        summary = train(cfg)
    (opt,) = toys["optimizers"]
    assert opt.steps == 2 and summary["steps"] == 2
    (sink,) = toys["sinks"]
    train_steps = [step for step, split, _ in sink.records if split == "train"]
    assert train_steps == [1, 2] and sink.closed
    assert any(split == "eval" for _, split, _ in sink.records)  # the final evaluation reaches it too
    assert all(isinstance(values["loss"], float) for _, split, values in sink.records if split == "train")
    assert sink.run_dir == tmp_path / "run"


def test_misspelt_registered_names_fail_at_load_with_did_you_mean(toys, tmp_path):
    with pytest.raises(ConfigError, match=r"optim.name `toy_sdg`\. Did you mean `toy_sgd`\?"):
        _config(tmp_path, tmp_path, "optim.name=toy_sdg")
    with pytest.raises(ConfigError, match=r"logging.sinks `toy_lst`\. Did you mean `toy_list`\?"):
        _config(tmp_path, tmp_path, "logging.sinks=[toy_lst]")


def test_registrations_do_not_outlive_their_test():
    with pytest.raises(ConfigError, match="unknown optim.name `toy_sgd`"):
        load_config(None, ["optim.name=toy_sgd"], cls=RunConfig)

"""Classification fine-tuning through the pretraining engine, from a transformers-made checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from finetune_fixtures import save_hf_bert_checkpoint, write_topic_task

from core.config import load_config
from pipelines.finetune import FinetuneConfig, run_finetune
from pipelines.finetune.data import FinetuneError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "finetune" / "classification.yaml"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return save_hf_bert_checkpoint(tmp_path_factory.mktemp("hf-bert"))


@pytest.fixture(scope="module")
def topic_task(tmp_path_factory):
    return write_topic_task(tmp_path_factory.mktemp("task"))


def overrides(checkpoint, task, run_dir, *extra):
    train, val = task
    return [f"checkpoint={checkpoint}", f"data.train={train}", f"data.validation={val}", f"train.run_dir={run_dir}",
            "data.micro_batch_size=16", "data.max_seq_len=64", "optim.lr=2e-3", "logging.progress=false",
            "logging.tensorboard=false", *extra]


def test_finetune_from_transformers_checkpoint_round_trips(hf_checkpoint, topic_task, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import models

    cfg = load_config(CONFIG, overrides(hf_checkpoint, topic_task, tmp_path / "run", "epochs=6"), cls=FinetuneConfig)
    result = run_finetune(cfg)
    release = Path(result["release_dir"])
    assert len(result["history"]) == 6 and result["best_step"] in [h["step"] for h in result["history"]]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["metrics"]["accuracy"] == result["metrics"]["accuracy"]
    assert result["metrics"]["accuracy"] > 0.5  # 3 balanced-ish classes: chance is ~0.33
    assert (tmp_path / "run" / "config.yaml").read_text().startswith("checkpoint:")  # the fine-tuning config

    # the release's card is Hub model-card metadata carrying the dev metrics of metrics.json
    from huggingface_hub import ModelCard

    card = ModelCard.load(release / "README.md")
    assert card.data.base_model == str(hf_checkpoint) and card.data.pipeline_tag == "text-classification"
    assert card.data.license and card.data.datasets == [str(cfg.data.train)]
    scores = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert scores["accuracy"] == pytest.approx(result["metrics"]["accuracy"], abs=1e-4)
    assert set(scores) == {"accuracy", "macro_f1", "mcc"}
    assert {r.dataset_type for r in card.data.eval_results} == {"csv"}  # the TSV task, read by `datasets`' csv loader
    assert "best epoch" in card.text and "accuracy" in card.text

    # label names travel through the exported config; transformers and our loader give the same logits
    hf = AutoModelForSequenceClassification.from_pretrained(release).eval()
    assert hf.config.id2label == {0: "debugger", 1: "formatstrings", 2: "string-methods"}
    ours, report = models.hf.from_hf(release)
    assert report.missing == [] and report.unexpected == []
    assert ours.id2label == hf.config.id2label
    enc = AutoTokenizer.from_pretrained(release)(["the pdb prompt", "str.upper returns a copy"], padding=True, return_token_type_ids=True,
                                                return_tensors="pt")
    with torch.no_grad():
        ref = hf(**enc).logits
        got = ours.eval()(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])["logits"]
    assert torch.allclose(ref, got, atol=1e-5)


def test_unknown_architecture_and_bad_labels_fail_clearly(hf_checkpoint, topic_task, tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = load_config(CONFIG, overrides(tmp_path / "empty", topic_task, tmp_path / "r1"), cls=FinetuneConfig)
    with pytest.raises(FinetuneError, match="not a release directory"):
        run_finetune(cfg)
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\n" + "".join(f"row {i}\tunknown-{i}\n" for i in range(20)))
    cfg = load_config(CONFIG, overrides(hf_checkpoint, (topic_task[0], bad), tmp_path / "r2"), cls=FinetuneConfig)
    with pytest.raises(FinetuneError, match="label not in the label set"):
        run_finetune(cfg)


@pytest.mark.slow
def test_two_process_deepspeed_finetune(hf_checkpoint, topic_task, tmp_path):
    from pipelines.engine.launcher import launch

    run_dir = tmp_path / "ds"
    code = launch(str(CONFIG), overrides(hf_checkpoint, topic_task, run_dir, "epochs=8", "distributed.engine=deepspeed",
                                         "distributed.zero_stage=2"), 2, module="pipelines.finetune")
    assert code == 0
    metrics = json.loads((run_dir / "metrics.json").read_text())
    history = metrics["history"]
    assert len(history) == 8 and history[-1]["loss"] < history[0]["loss"]  # dev loss falls across epochs
    assert metrics["metrics"]["accuracy"] > 0.45  # 3 classes of 20 dev sentences each: chance is 0.33
    # the ranks scored the export (each its share of the batches) as one process scores it
    from pipelines.finetune.classification import evaluate_release
    from pipelines.finetune.data import read_examples

    _, labels, _ = read_examples(topic_task[0], text_column="text", label_column="label")
    dev, _, _ = read_examples(topic_task[1], text_column="text", label_column="label", label_names=labels)
    assert metrics["metrics"] == evaluate_release(run_dir / "release", dev, 64, labels, False)


@pytest.mark.parametrize("global_batch", [0, 16])
def test_logged_step_flops_are_the_flops_the_model_ran(hf_checkpoint, tmp_path, global_batch):
    """Fine-tuning's FLOPs per step (what MFU divides) equal what torch counts for a step of the batch the run
    trains on: the encoder at the examples' length, the pooler and the classifier (no padding in these batches).
    With ``train.global_batch_size=16`` the 32 examples take 2 steps of 2 accumulated micro-batches of 8."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoTokenizer

    from pipelines.finetune.classification import ClassificationTask, build_classifier, collate_classification
    from pipelines.finetune.data import encode_examples, read_examples

    words = {"alpha": "the", "beta": "and"}
    rows = [(" ".join([words[label]] * 20), label) for label in ("alpha", "beta") for _ in range(16)]
    train = tmp_path / "same_length.tsv"
    train.write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    run = tmp_path / "run"
    run_finetune(load_config(CONFIG, overrides(hf_checkpoint, (train, train), run, "epochs=1", "data.micro_batch_size=8",
                                                "train.log_every=1", f"train.global_batch_size={global_batch}"),
                             cls=FinetuneConfig))
    logged = [r["step_flops"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r.get("split") == "train"]
    micro_batches = 2 if global_batch else 1
    assert len(logged) == 4 // micro_batches

    tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    examples, labels, _ = read_examples(train, text_column="text", label_column="label")
    feats = encode_examples(examples, tok, 64)
    assert len({len(f["input_ids"]) for f in feats}) == 1  # every batch is 8 x the same length: nothing padded
    model = build_classifier(hf_checkpoint, labels, False, "pretrained", 0).train()
    batch = collate_classification(feats[:8], tok.pad_token_id)
    task = ClassificationTask(len(labels), tok.pad_token_id, 64)
    with FlopCounterMode(display=False) as counted:
        task.forward(model, {**batch, "valid": torch.ones(8, dtype=torch.bool)})["loss"].backward()
    assert logged == [counted.get_total_flops() * micro_batches] * (4 // micro_batches)


@pytest.mark.slow
def test_the_readme_classification_command_learns_on_a_bert_tiny_size_release(tmp_path):
    """README.md's fine-tuning command, run as written (its release and files swapped for a bert-tiny-size
    release and a 3-topic task), learns the task. classification.yaml's BERT-base recipe (lr 1e-4,
    3 epochs: 21 updates here) stayed near chance: 0.383, as the demo's release stayed at the majority class.
    On 60 validation sentences the small recipe scored 0.500-0.517 (one sentence from the bar) from one
    machine to the next; on 84 (every topic's sentences used) 0.667."""
    import re
    import shlex

    from finetune_fixtures import save_wordpiece_tokenizer
    from transformers import BertConfig, BertForPreTraining

    from pipelines.cli import main

    readme = (REPO / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(m for m in re.findall(r"^pretrain finetune .*$", readme, re.M) if "classification" in m)
    words = shlex.split(line)
    release = save_wordpiece_tokenizer(tmp_path / "release")
    torch.manual_seed(0)  # the README's bert-tiny: 2 layers, hidden 128 (random init: the task alone must be learned)
    BertForPreTraining(BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=512, max_position_embeddings=512)).save_pretrained(str(release))
    train, val = write_topic_task(tmp_path, per_class=140)  # all three topics' sentences: 84 to validate on
    swap = {"checkpoint": release, "data.train": train, "data.validation": val}
    args = [f"{w.split('=')[0]}={swap[w.split('=')[0]]}" if w.split("=")[0] in swap else w for w in words[1:]]
    run = tmp_path / "run"
    assert main([*args, f"train.run_dir={run}", "logging.progress=false", "logging.tensorboard=false"]) == 0
    metrics = json.loads((run / "metrics.json").read_text())["metrics"]
    assert metrics["accuracy"] > 0.5 and metrics["mcc"] > 0.3, metrics  # 3 topics: chance is 0.33


def test_the_shipped_config_resumes_when_the_job_runs_again(hf_checkpoint, topic_task, tmp_path, capsys):
    """A requeued job runs the same command again: with the shipped `train.resume: auto` it continues from
    its newest checkpoint instead of being refused for a run dir with checkpoints -- here the last one, so
    it has no step left to train and says so, naming `epochs` (it said to raise train.max_steps, which fine-tuning
    sets from epochs), and releases the same model.

    Run again with another micro batch (or `--nproc`), the epochs would have other ends: it resumed, counted its
    epochs from the wrong steps, dropped the finished ones from the selection and overwrote the release. Refused."""
    from monitoring.logger import read_metrics_lines

    run = tmp_path / "run"
    args = overrides(hf_checkpoint, topic_task, run, "epochs=1")
    first = run_finetune(load_config(CONFIG, args, cls=FinetuneConfig))
    capsys.readouterr()
    second = run_finetune(load_config(CONFIG, args, cls=FinetuneConfig))
    out = capsys.readouterr().out
    assert f"run {run} has trained its 1 epoch(s) (checkpoint {run / 'checkpoints'}" in out, out[-2000:]
    assert "nothing to train. Raise epochs to train further" in out and "max_steps" not in out, out[-2000:]
    assert second["best_step"] == first["best_step"] and second["metrics"] == pytest.approx(first["metrics"])
    steps = [r["step"] for r in read_metrics_lines(run / "metrics.jsonl") if r.get("split") == "train"]
    assert steps == sorted(set(steps))  # no step trained twice

    written = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    per_epoch = first["steps"]  # one epoch
    with pytest.raises(FinetuneError, match=rf"holds a run of {per_epoch} steps an epoch \(1 process\(es\) x micro-batch 16 "
                                            rf"x 1 accumulated.*this command makes {2 * per_epoch} \(1 x 8 x 1\).*new train.run_dir"):
        run_finetune(load_config(CONFIG, [*args, "data.micro_batch_size=8", "epochs=3"], cls=FinetuneConfig))
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == written  # nothing trained or rewritten


def test_best_epoch_breaks_a_tie_of_the_selection_metric_by_the_dev_loss(tmp_path):
    """Equal dev window accuracy on a small dev set is a tie of counts, not of models: the epoch with the
    lower dev loss is kept (issue #31); with equal losses too, the earlier one."""
    from pipelines.finetune.runner import best_epoch

    rows = [{"step": 7, "split": "eval", "accuracy": 0.014, "loss": 3.9}, {"step": 10, "split": "eval", "accuracy": 0.9},
            {"step": 14, "split": "eval", "accuracy": 0.649, "loss": 1.41}, {"step": 14, "split": "train", "loss": 1.0},
            {"step": 21, "split": "eval", "accuracy": 0.649, "loss": 1.17}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step, history = best_epoch(tmp_path, "accuracy", 7)  # step 10 is no epoch end: not a candidate
    assert step == 21 and [h["epoch"] for h in history] == [1, 2, 3]
    assert best_epoch(tmp_path, "loss", 7)[0] == 21
    rows[-1]["loss"] = 1.41
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert best_epoch(tmp_path, "accuracy", 7)[0] == 14


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_any_work(tmp_path, topic_task, capsys):
    """A release whose tokenizer (another corpus's) has ids past the embedding table: one paragraph naming
    the release and both sizes, exit 2, nothing written (it was an IndexError mid-forward). A model
    vocabulary padded beyond the tokenizer's (GPT-2's 50304) still loads."""
    from finetune_fixtures import save_wordpiece_tokenizer

    from pipelines.cli import main
    from pipelines.finetune.runner import load_tokenizer

    release = save_hf_bert_checkpoint(tmp_path / "release", vocab_size=300)
    save_wordpiece_tokenizer(tmp_path / "release", vocab_size=1000)  # the bigger tokenizer copied over the release's
    run = tmp_path / "run"
    code = main(["finetune", str(CONFIG), *overrides(release, topic_task, run, "epochs=1")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"{release}: its tokenizer has" in err and "vocab_size) has 300 rows" in err and not run.exists(), err

    padded = save_hf_bert_checkpoint(tmp_path / "padded", vocab_size=300)
    config = json.loads((padded / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps({**config, "vocab_size": 320}))  # rows the tokenizer never uses
    assert len(load_tokenizer(padded)) == 300


def test_a_missing_or_file_checkpoint_says_so(tmp_path, topic_task):
    """checkpoint= a path that is not there, or a file: the message says which (not 'no config.json')."""
    (tmp_path / "model.bin").write_bytes(b"\0")
    for path, says in ((tmp_path / "absent", "does not exist"), (tmp_path / "model.bin", "is a file, not a directory")):
        cfg = load_config(CONFIG, overrides(path, topic_task, tmp_path / "run"), cls=FinetuneConfig)
        with pytest.raises(FinetuneError, match=f"checkpoint={path} {says}"):
            run_finetune(cfg)
        assert not (tmp_path / "run").exists()

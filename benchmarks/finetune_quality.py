"""Fine-tuning quality: ours (`pretrain finetune`) vs `transformers.Trainer`, same release, data and hyper-parameters.

For each task, in one run and for each ``--seeds``:

* **ours**: `pipelines.finetune.run_finetune` with `configs/finetune/{qa,classification}.yaml` and
  the overrides below; the score is what it writes to `metrics.json` (the exported model's dev score).
* **HF**: `transformers.Trainer` + `AutoModelFor{QuestionAnswering,SequenceClassification}` from the
  same release, the standard preprocessing (QA: windows of ``--seq`` tokens overlapping by
  ``--stride``, every window trained on, a window without the whole answer labelled at [CLS];
  classification: truncation to ``--seq``), AdamW with the same LR, weight decay, warmup steps,
  linear decay, batch, epochs and gradient clipping (1.0). Its model is saved as a release and
  scored by the same dev scorer as ours (`pipelines.finetune.qa.predict_release` for QA,
  `classification.evaluate_release` for classification), so only training differs.

Data are built from text that ships with Python (`pipelines.ops.demo_data`): QA = the package
question with the five package names in the context (SQuAD v1.1 JSON); with ``--qa-data
cloze``, cloze questions on `pydoc_data.topics` paragraphs; with ``--qa-data where``, "Where is the
word W?" on those paragraphs (W's one span is the answer, in any window of a long paragraph);
classification = which package a docstring comes from. The release is ``--release DIR`` (any BERT-architecture transformers
directory with a fast tokenizer), else a BERT of ``--layers``/``--hidden`` with a WordPiece
tokenizer trained on the pydoc topics, random weights drawn by transformers (seed 0). ``--dropout P``
fine-tunes both sides with hidden/attention dropout P instead of the release's; ``--max-per-class``
keeps fewer classification docstrings (a smaller, cheaper run).

Prints per task and seed both scores and the gap (ours - HF), then the means.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_release(out: Path, layers: int, hidden: int, vocab: int = 4000) -> Path:
    """A random-init transformers BERT (BertForMaskedLM) with a WordPiece tokenizer trained on the pydoc topics."""
    from pydoc_data.topics import topics

    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(fast), hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                               max_position_embeddings=512)).save_pretrained(str(out))
    fast.save_pretrained(str(out))
    return out


def with_dropout(release: Path, out: Path, p: float) -> Path:
    """A view of ``release`` whose config.json sets hidden and attention-probability dropout to ``p``
    (the other files are symlinked), so both sides fine-tune with that dropout."""
    out.mkdir(parents=True)
    for f in release.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((release / "config.json").read_text(encoding="utf-8"))
    config.update(hidden_dropout_prob=p, attention_probs_dropout_prob=p)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


def _paragraph_task(out: Path, max_train: int, max_dev: int, questions) -> None:
    """SQuAD files of questions on `pydoc_data.topics` paragraphs: ``questions(name, index, paragraph)`` makes
    a paragraph's `QAExample` s; every 5th topic (by name) is dev. Code samples and short paragraphs are skipped."""
    from pydoc_data.topics import topics

    from pipelines.finetune.squad import write_squad

    names = sorted(topics)
    dev_topics = set(names[::5])
    split: dict[str, list] = {"train": [], "dev": []}
    for name in names:
        for p, para in enumerate(re.split(r"\n\s*\n", topics[name])):
            if len(para) < 200 or any(line.startswith(" ") for line in para.splitlines()) or "***" in para:
                continue
            split["dev" if name in dev_topics else "train"].extend(questions(name, p, para))
    write_squad(out / "train.json", split["train"][:max_train])
    write_squad(out / "dev.json", split["dev"][:max_dev])


def cloze_task(out: Path, max_train: int, max_dev: int) -> None:
    """Cloze QA on pydoc topic paragraphs: a sentence with its longest word blanked asks for that word."""
    from pipelines.finetune.squad import QAExample

    def questions(name: str, p: int, para: str) -> list[QAExample]:
        rows = []
        for k, m in enumerate(list(re.finditer(r"[^.!?]+[.!?]", para))[:3]):
            sent, s0 = m.group(0), m.start()
            words = list(re.finditer(r"[A-Za-z]{4,}", sent))[1:]
            if len(sent.split()) < 8 or not words:
                continue
            w = max(words, key=lambda x: (len(x.group(0)), -x.start()))
            question = " ".join((sent[: w.start()] + "[MASK]" + sent[w.end():]).split())
            rows.append(QAExample(f"{name}-{p}-{k}", question, para, [{"text": w.group(0), "answer_start": s0 + w.start()}],
                                  False, name))
        return rows

    _paragraph_task(out, max_train, max_dev, questions)


def where_task(out: Path, max_train: int, max_dev: int) -> None:
    """Word-finding QA on pydoc topic paragraphs: "Where is the word W?" asks for W's one span in the paragraph.

    W is a word of 5+ letters that occurs once in the paragraph (up to 6 per paragraph, picked by a
    seeded hash, not by position). The answer can sit in any window of a long paragraph, so a model
    must learn which window holds it; a pretrained encoder helps by knowing W's pieces.
    """
    import hashlib
    from collections import Counter

    from pipelines.finetune.squad import QAExample

    def questions(name: str, p: int, para: str) -> list[QAExample]:
        words = list(re.finditer(r"\b[A-Za-z]{5,}\b", para))
        counts = Counter(m.group(0).lower() for m in words)
        once = sorted((m for m in words if counts[m.group(0).lower()] == 1),
                      key=lambda m: hashlib.sha256(f"{name}/{p}/{m.group(0)}".encode()).digest())
        return [QAExample(f"{name}-{p}-{k}", f"Where is the word {m.group(0)}?", para,
                          [{"text": m.group(0), "answer_start": m.start()}], False, name) for k, m in enumerate(once[:6])]

    _paragraph_task(out, max_train, max_dev, questions)


def common_overrides(args: argparse.Namespace, seed: int) -> dict[str, object]:
    return {"epochs": args.epochs, "data.max_seq_len": args.seq, "data.micro_batch_size": args.batch, "optim.lr": args.lr,
            "optim.weight_decay": 0.01, "schedule.warmup_steps": args.warmup, "train.seed": seed,
            "train.log_every": 10_000, "logging.tensorboard": False, "logging.progress": False}


def ours(task: str, release: Path, data: Path, run_dir: Path, args: argparse.Namespace, seed: int) -> float:
    from core.config import load_config
    from pipelines.finetune import FinetuneConfig, run_finetune

    over = {**common_overrides(args, seed), "checkpoint": release, "train.run_dir": run_dir}
    if task == "qa":
        over.update({"data.train": data / "train.json", "data.validation": data / "dev.json", "qa.doc_stride": args.stride})
    else:
        over.update({"data.train": data / "train.tsv", "data.validation": data / "validation.tsv"})
    cfg = load_config(REPO / f"configs/finetune/{'qa' if task == 'qa' else 'classification'}.yaml",
                      [f"{k}={v}" for k, v in over.items()], cls=FinetuneConfig)
    metrics = run_finetune(cfg)["metrics"]
    return metrics["f1"] if task == "qa" else 100.0 * metrics["accuracy"]


def hf_training_args(out: Path, args: argparse.Namespace, seed: int, *, per_epoch: bool = False):
    """``per_epoch``: evaluate and save every epoch and reload the best at the end (our cadence)."""
    from transformers import TrainingArguments

    cadence = "epoch" if per_epoch else "no"
    return TrainingArguments(
        output_dir=str(out), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch, learning_rate=args.lr,
        weight_decay=0.01, warmup_steps=args.warmup, lr_scheduler_type="linear", max_grad_norm=1.0, seed=seed,
        save_strategy=cadence, eval_strategy=cadence, load_best_model_at_end=per_epoch, metric_for_best_model="loss",
        per_device_eval_batch_size=args.batch, logging_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)


def hf_qa_features(examples, tokenizer, args: argparse.Namespace) -> list[dict[str, object]]:
    """The standard extractive-QA training windows: every window kept, out-of-window answers at [CLS] (index 0)."""
    from pipelines.finetune.squad import _truncate_question

    questions = [_truncate_question(tokenizer, e.question, 64) for e in examples]  # qa.max_query_len, as ours
    enc = tokenizer(questions, [e.context for e in examples], truncation="only_second",
                    max_length=args.seq, stride=args.stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                    return_token_type_ids=True)
    feats = []
    for i, ex_i in enumerate(enc["overflow_to_sample_mapping"]):
        ex = examples[ex_i]
        a0 = ex.answers[0]["answer_start"]
        a1 = a0 + len(ex.answers[0]["text"])
        seq, offs = enc.sequence_ids(i), enc["offset_mapping"][i]
        ctx = [k for k, s in enumerate(seq) if s == 1]
        start = end = 0
        if offs[ctx[0]][0] <= a0 and offs[ctx[-1]][1] >= a1:
            start = next(k for k in ctx if offs[k][1] > a0)
            end = next(k for k in reversed(ctx) if offs[k][0] < a1)
        feats.append({"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                      "attention_mask": enc["attention_mask"][i], "start_positions": start, "end_positions": end})
    return feats


def hf(task: str, release: Path, data: Path, out: Path, args: argparse.Namespace, seed: int, *,
       per_epoch: bool = False) -> float:
    """Train with `transformers.Trainer`, save the release, score it with our dev scorer (``per_epoch``:
    evaluate the dev set and save a checkpoint every epoch, keep the best, as our fine-tuning does)."""
    import transformers
    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer

    from core.config import load_config
    from pipelines.finetune import FinetuneConfig

    tokenizer = AutoTokenizer.from_pretrained(str(release))
    collator = DataCollatorWithPadding(tokenizer)
    transformers.set_seed(seed)
    if task == "qa":
        from pipelines.finetune.qa import predict_release
        from pipelines.finetune.squad import read_squad, squad_metrics

        train_ex, _ = read_squad(data / "train.json")
        model = transformers.AutoModelForQuestionAnswering.from_pretrained(str(release))
        train = hf_qa_features(train_ex, tokenizer, args)
        dev = hf_qa_features(read_squad(data / "dev.json")[0], tokenizer, args) if per_epoch else None
    else:
        from pipelines.finetune.classification import evaluate_release
        from pipelines.finetune.data import read_examples

        train_ex, labels, _ = read_examples(data / "train.tsv", text_column="text", label_column="label")
        val_ex, _, _ = read_examples(data / "validation.tsv", text_column="text", label_column="label", label_names=labels)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(release), num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})

        def encode(examples):
            enc = tokenizer([e.text for e in examples], truncation=True, max_length=args.seq, return_token_type_ids=True)
            return [{"input_ids": ids, "token_type_ids": tt, "attention_mask": am, "labels": e.label} for ids, tt, am, e
                    in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], examples, strict=True)]

        train, dev = encode(train_ex), (encode(val_ex) if per_epoch else None)
    Trainer(model=model, args=hf_training_args(out / "hf-trainer", args, seed, per_epoch=per_epoch), train_dataset=train,
            eval_dataset=dev, data_collator=collator).train()
    model.save_pretrained(str(out / "release"))
    tokenizer.save_pretrained(str(out / "release"))
    if task == "qa":
        cfg = load_config(REPO / "configs/finetune/qa.yaml", [f"data.max_seq_len={args.seq}", f"qa.doc_stride={args.stride}"],
                          cls=FinetuneConfig)
        dev_ex, _ = read_squad(data / "dev.json")
        predictions, _ = predict_release(out / "release", dev_ex, cfg)
        return squad_metrics(dev_ex, predictions)["f1"]
    return 100.0 * evaluate_release(out / "release", val_ex, args.seq, labels, False)["accuracy"]


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    """The release and the fine-tuning recipe both sides share (also used by finetune_throughput.py)."""
    parser.add_argument("--release", default="", help="BERT release dir; default: a random-init one built here")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--stride", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="qa,classification", help="comma-separated: qa, classification")
    parser.add_argument("--qa-data", default="package", choices=["package", "cloze", "where"])
    add_recipe_args(parser)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--max-train", type=int, default=1200, help="cloze/where: training questions kept")
    parser.add_argument("--max-dev", type=int, default=300, help="cloze/where: dev questions kept")
    parser.add_argument("--max-per-class", type=int, default=0,
                        help="classification: docstrings kept per package and split (0 = all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=None,
                        help="fine-tune both sides with this hidden/attention dropout instead of the release's")
    args = parser.parse_args(argv)

    import torch

    from pipelines.ops.demo_data import write_classification_task, write_package_qa_task

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="finetune-quality-"))
    release = Path(args.release) if args.release else make_release(root / "release", args.layers, args.hidden)
    if args.dropout is not None:
        release = with_dropout(release, root / f"release-dropout-{args.dropout}", args.dropout)
    results: dict[str, list[tuple[float, float]]] = {}
    for task in args.tasks.split(","):
        data = root / f"data-{task}"
        if task == "qa" and args.qa_data in ("cloze", "where"):
            (cloze_task if args.qa_data == "cloze" else where_task)(data, args.max_train, args.max_dev)
        elif task == "qa":
            write_package_qa_task(data)
        else:
            write_classification_task(data, max_per_class=args.max_per_class or None)
        metric = "F1" if task == "qa" else "accuracy"
        for seed in (int(s) for s in args.seeds.split(",")):
            a = ours(task, release, data, root / f"ours-{task}-{seed}", args, seed)
            b = hf(task, release, data, root / f"hf-{task}-{seed}", args, seed)
            results.setdefault(task, []).append((a, b))
            print(f"{task:15s} seed {seed}: ours {metric} {a:6.2f}   HF Trainer {b:6.2f}   gap {a - b:+6.2f}", flush=True)
    print(f"\nrelease {release}; epochs {args.epochs}, seq {args.seq}, batch {args.batch}, lr {args.lr}, warmup {args.warmup}")
    for task, rows in results.items():
        a, b = statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)
        print(f"{task:15s} mean over {len(rows)} seed(s): ours {a:6.2f}   HF Trainer {b:6.2f}   gap {a - b:+6.2f}")
    print(json.dumps({t: {"ours": [r[0] for r in v], "hf": [r[1] for r in v]} for t, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

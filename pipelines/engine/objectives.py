"""Training objectives: how samples become batches, and batches become losses and metrics.

A task is registered with ``@register_task(name)`` on a factory ``(cfg: RunConfig, manifest |
None) -> Task``; ``build_task(cfg, manifest)`` looks it up. Adding ``classification`` or ``qa`` is
one decorated factory returning a ``Task`` subclass (see the ``Task`` docstring for the methods).

Randomness here (MLM masking, crops, flips, mixup) is drawn from ``rng(seed, epoch, sample key)``,
never from the global RNG, so it is the same whichever rank/worker decodes a sample and after resume.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np
import torch

from core.config import ConfigError
from pipelines.engine.registries import TASKS, TaskSpec

__all__ = ["Task", "TASKS", "register_task", "build_task", "list_tasks", "key_seed", "MLMNSPTask", "CausalLMTask", "ImageClsTask"]

def register_task(name: str):
    """Register ``factory(cfg, manifest) -> Task`` under ``name`` (``train.task``)."""

    def deco(factory):
        TASKS.register(name, TaskSpec(factory=factory))
        return factory

    return deco


def list_tasks() -> list[str]:
    return TASKS.names()


def build_task(cfg: Any, manifest: Any = None) -> Task:
    spec = TASKS.lookup(cfg.train.task)
    factory = spec.resolve()
    if factory is None:
        runnable = ", ".join(n for n in TASKS.names() if TASKS[n].runner == "pretrain train")
        raise ConfigError(
            f"train.task={cfg.train.task!r} has no registered objective here (registered: {runnable}). "
            f"Pretraining supports {runnable}; use `{spec.runner}` for this task."
        )
    return factory(cfg, manifest)


def key_seed(*parts: Any) -> int:
    """A stable 64-bit seed from (seed, epoch, sample key, ...)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _rng(*parts: Any) -> np.random.Generator:
    return np.random.default_rng(key_seed(*parts))


class Task:
    """Base objective. Subclasses set ``name``/``corpus_kind``/``family`` and override as needed.

    - ``collate(samples, epoch=, train=) -> dict`` (runs in DataLoader workers; samples come from
      ``data.decode_sample`` for streaming corpora or from your dataset for ``MapStyleSource``; a
      sample's own ``epoch`` field, set by a corpus mixture, wins over ``epoch``);
    - ``forward(model, batch) -> dict`` with a scalar ``loss`` (default: ``model(**model_inputs)``);
    - ``tokens(batch) -> int`` counted toward ``train.max_tokens`` and throughput;
    - ``eval_sums(outputs, batch) -> {name: float}`` additive over batches and ranks;
    - ``eval_metrics(sums) -> {name: float}`` the final metrics;
    - ``model_overrides() -> dict`` model config fields the data imposes (vocab size, labels).
    """

    name = ""
    unit = "tok"  # what ``tokens(batch)`` counts, as the progress line's throughput shows it ("img/s" for images)
    corpus_kind: str | None = None
    family: str | None = None
    input_names: tuple[str, ...] = ()

    def collate(self, samples: list[Any], *, epoch: int, train: bool) -> dict[str, Any]:
        raise NotImplementedError

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in self.input_names if k in batch}

    def forward(self, model: Any, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return model(**self.model_inputs(batch))

    def tokens(self, batch: dict[str, Any]) -> int:
        return int(batch["input_ids"].numel())

    def eval_sums(self, out: dict[str, torch.Tensor], batch: dict[str, Any]) -> dict[str, float]:
        return {"loss": float(out["loss"]), "batches": 1.0}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss"] / max(sums["batches"], 1.0)}

    def model_overrides(self) -> dict[str, Any]:
        return {}

    def batch_flops(self, batch: dict[str, Any], config: Any) -> float | None:
        """This batch's training FLOPs when samples differ in length (None: ``flops_kwargs`` per sample)."""
        return None

    def flops_kwargs(self) -> dict[str, Any]:
        """Arguments of ``models.flops.training_flops_per_sample`` that describe this task's work."""
        return {"seq_len": getattr(self, "seq_len", None) or None}


def _pad(rows: list[np.ndarray], length: int, value: int) -> torch.Tensor:
    out = np.full((len(rows), length), value, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


class MLMNSPTask(Task):
    """BERT: dynamic masking (15 % of non-special tokens; 80 % [MASK] / 10 % random / 10 % kept) + NSP."""

    name, corpus_kind, family = "mlm_nsp", "bert_pairs", "bert"
    input_names = ("input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label")

    def __init__(self, manifest: Any, *, seed: int, probability: float = 0.15, whole_word: bool = False):
        sp = manifest.special_tokens
        if "mask_token" not in sp:
            raise ConfigError(f"{manifest.root}/manifest.json lists no mask_token among the tokenizer's special tokens; mlm_nsp needs [MASK].")
        self.seed, self.p, self.whole_word = seed, probability, whole_word
        self.mask_id, self.pad_id = sp["mask_token"], sp.get("pad_token", 0)
        self.vocab_size, self.seq_len = manifest.vocab_size, manifest.seq_len
        self.special = np.zeros(max(self.vocab_size, max(sp.values()) + 1), dtype=bool)
        self.special[list(sp.values())] = True
        self.continuation = None
        if whole_word:  # WordPiece continuation pieces start with "##"
            vocab = json.loads((manifest.tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
            self.continuation = np.zeros(len(self.special), dtype=bool)
            for tok, i in vocab.items():
                if tok.startswith("##") and i < len(self.continuation):
                    self.continuation[i] = True

    def mask(self, ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(masked ids, labels) with labels -100 except at the selected positions."""
        cand = np.flatnonzero(~self.special[ids])
        labels = np.full(len(ids), -100, dtype=np.int64)
        if len(cand) == 0:
            return ids.copy(), labels
        n = max(1, int(round(len(cand) * self.p)))
        if self.continuation is None:
            chosen = rng.choice(cand, size=min(n, len(cand)), replace=False)
        else:
            words: list[list[int]] = []
            for i in cand:
                if words and self.continuation[ids[i]] and words[-1][-1] == i - 1:
                    words[-1].append(int(i))
                else:
                    words.append([int(i)])
            picked: list[int] = []
            for w in rng.permutation(len(words)):
                if len(picked) >= n:
                    break
                picked.extend(words[w])
            chosen = np.array(picked, dtype=np.int64)
        out = ids.copy()
        labels[chosen] = ids[chosen]
        r = rng.random(len(chosen))
        out[chosen[r < 0.8]] = self.mask_id
        rand = chosen[(r >= 0.8) & (r < 0.9)]
        out[rand] = rng.integers(0, self.vocab_size, size=len(rand))
        return out, labels

    def collate(self, samples, *, epoch, train):
        ids, labels, types = [], [], []
        for s in samples:
            masked, lab = self.mask(s["input_ids"], _rng(self.seed, s.get("epoch", epoch) if train else -1, s["key"]))
            ids.append(masked)
            labels.append(lab)
            types.append(np.r_[np.zeros(s["len_a"] + 2, np.int64), np.ones(s["len_b"] + 1, np.int64)])
        longest = max(len(x) for x in ids)
        length = min(-(-longest // 8) * 8, max(self.seq_len, longest))
        return {
            "input_ids": _pad(ids, length, self.pad_id),
            "attention_mask": _pad([np.ones(len(x), np.int64) for x in ids], length, 0),
            "token_type_ids": _pad(types, length, 0),
            "labels": _pad(labels, length, -100),
            "next_sentence_label": torch.tensor([s["next_sentence_label"] for s in samples], dtype=torch.long),
            "keys": [s["key"] for s in samples],
            "num_bad": sum(1 for s in samples if s.get("bad")),
        }

    def tokens(self, batch):
        return int(batch["attention_mask"].sum())

    def flops_kwargs(self):
        # the sparse MLM head projects to the vocabulary only at the masked share of positions
        return {"seq_len": self.seq_len, "mlm_fraction": self.p}

    def eval_sums(self, out, batch):
        labels = batch["labels"]
        sel = labels != -100
        n_mlm = float(sel.sum())
        pred = out["masked_prediction_logits"].argmax(-1)  # rows follow labels[sel] (sparse MLM head)
        nsp_pred = out["seq_relationship_logits"].argmax(-1)
        n_nsp = float(batch["next_sentence_label"].numel())
        return {
            "mlm_correct": float((pred == labels[sel]).sum()), "mlm_count": n_mlm,
            "mlm_loss_sum": float(out["mlm_loss"]) * n_mlm,
            "nsp_correct": float((nsp_pred == batch["next_sentence_label"].view(-1)).sum()), "nsp_count": n_nsp,
            "nsp_loss_sum": float(out["nsp_loss"]) * n_nsp,
        }

    def eval_metrics(self, s):
        mlm_loss = s["mlm_loss_sum"] / max(s["mlm_count"], 1.0)
        nsp_loss = s["nsp_loss_sum"] / max(s["nsp_count"], 1.0)
        return {
            "loss": mlm_loss + nsp_loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1.0),
            "nsp_accuracy": s["nsp_correct"] / max(s["nsp_count"], 1.0),
            "perplexity": math.exp(min(mlm_loss, 50.0)),
        }

    def model_overrides(self):
        return {"vocab_size": self.vocab_size, "pad_token_id": self.pad_id}


class CausalLMTask(Task):
    """GPT: packed windows of seq_len+1 tokens -> inputs [:-1], next-token labels [1:]."""

    name, corpus_kind, family = "causal_lm", "packed_lm", "gpt"
    input_names = ("input_ids", "labels")

    def __init__(self, manifest: Any):
        self.vocab_size, self.seq_len = manifest.vocab_size, manifest.seq_len

    def collate(self, samples, *, epoch, train):
        for s in samples:
            if len(s["input_ids"]) != self.seq_len + 1:
                raise ValueError(f"sample {s['key']} has {len(s['input_ids'])} tokens, expected seq_len+1={self.seq_len + 1}")
        ids = torch.from_numpy(np.stack([s["input_ids"] for s in samples]))
        return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                "keys": [s["key"] for s in samples], "num_bad": sum(1 for s in samples if s.get("bad"))}

    def eval_sums(self, out, batch):
        labels = batch["labels"]
        n = float((labels != -100).sum())
        return {"loss_sum": float(out["loss"]) * n, "tokens": n,
                "correct": float((out["logits"].argmax(-1) == labels).sum())}

    def eval_metrics(self, s):
        loss = s["loss_sum"] / max(s["tokens"], 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": s["correct"] / max(s["tokens"], 1.0)}

    def model_overrides(self):
        return {"vocab_size": self.vocab_size}


class ImageClsTask(Task):
    """ViT: random-resized-crop + flip (train) / resize + center-crop (eval), optional mixup; top-1."""

    name, corpus_kind, family = "image_cls", "images", "vit"
    unit = "img"
    input_names = ("pixel_values", "labels")
    mean = std = 0.5  # transformers' ViTImageProcessor defaults

    def __init__(self, manifest: Any, *, seed: int, image_size: int, mixup_alpha: float = 0.0):
        if not manifest.class_map:
            raise ConfigError(f"{manifest.root}/manifest.json has no class_map; image_cls needs labelled images.")
        self.seed, self.size, self.alpha = seed, image_size, mixup_alpha
        self.num_labels = max(manifest.class_map.values()) + 1
        self.class_map = manifest.class_map

    def _random_resized_crop(self, img, rng):
        w, h = img.size
        area = w * h
        for _ in range(10):
            target = area * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
                return (x, y, x + cw, y + ch)
        side = min(w, h)  # fallback: central square
        return ((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2)

    @staticmethod
    def eval_resize(image_size: int) -> int:
        """Shorter side before the eval centre crop: 256 for 224 (the ratio of ViT's and ResNet's evaluations)."""
        return image_size * 256 // 224

    @classmethod
    def eval_processor_config(cls, image_size: int) -> dict[str, Any]:
        """``preprocessor_config.json`` that makes ``transformers`` see the pixels our eval sees.

        ``CLIPImageProcessor`` is the standard processor that resizes the shorter side and centre-crops
        in every supported ``transformers`` version (``ViTImageProcessor`` squashes to a square);
        with its PIL backend it gives the same tensor as ``transform(img, None)`` (tested).
        """
        return {
            "image_processor_type": "CLIPImageProcessor", "do_convert_rgb": True,
            "do_resize": True, "size": {"shortest_edge": cls.eval_resize(image_size)}, "resample": 2,  # PIL bilinear
            "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [cls.mean] * 3, "image_std": [cls.std] * 3,
        }  # fmt: skip

    def transform(self, img, rng: np.random.Generator | None) -> torch.Tensor:
        from PIL import Image

        S = self.size
        if rng is not None:
            img = img.resize((S, S), Image.BILINEAR, box=self._random_resized_crop(img, rng))
            if rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:  # the arithmetic of transformers' shortest_edge resize + center crop (see eval_processor_config)
            w, h = img.size
            short = self.eval_resize(S)
            size = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
            img = img.resize(size, Image.BILINEAR)
            w, h = img.size
            left, top = (w - S) // 2, (h - S) // 2
            img = img.crop((left, top, left + S, top + S))
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - self.mean) / self.std

    def collate(self, samples, *, epoch, train):
        px = torch.stack([self.transform(s["image"], _rng(self.seed, s.get("epoch", epoch), s["key"]) if train else None)
                          for s in samples])
        labels = torch.tensor([s["label"] for s in samples], dtype=torch.long)
        batch = {"pixel_values": px, "labels": labels, "keys": [s["key"] for s in samples],
                 "num_bad": sum(1 for s in samples if s.get("bad"))}
        if train and self.alpha > 0:
            lam = float(_rng(self.seed, samples[0].get("epoch", epoch), samples[0]["key"], "mixup").beta(self.alpha, self.alpha))
            onehot = torch.nn.functional.one_hot(labels, self.num_labels).float()
            batch["pixel_values"] = lam * px + (1 - lam) * px.roll(1, 0)
            batch["labels"] = lam * onehot + (1 - lam) * onehot.roll(1, 0)
        return batch

    def tokens(self, batch):
        return int(batch["pixel_values"].shape[0])  # images

    def eval_sums(self, out, batch):
        n = float(batch["labels"].shape[0])
        return {"loss_sum": float(out["loss"]) * n, "count": n,
                "correct": float((out["logits"].argmax(-1) == batch["labels"]).sum())}

    def eval_metrics(self, s):
        return {"loss": s["loss_sum"] / max(s["count"], 1.0), "top1": s["correct"] / max(s["count"], 1.0)}

    def model_overrides(self):
        return {"num_labels": self.num_labels, "image_size": self.size}


def _mlm_nsp(cfg, manifest):
    return MLMNSPTask(manifest, seed=cfg.train.seed, probability=cfg.data.mlm_probability, whole_word=cfg.data.whole_word_masking)


def _causal_lm(cfg, manifest):
    return CausalLMTask(manifest)


def _image_cls(cfg, manifest):
    return ImageClsTask(manifest, seed=cfg.train.seed, image_size=cfg.data.image_size, mixup_alpha=cfg.data.mixup_alpha)

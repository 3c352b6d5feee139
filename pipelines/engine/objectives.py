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
from core.corpus import DataError
from core.families import vit as vit_family
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
    """Base objective. Subclasses set ``name`` and override as needed; which model families pretrain
    under a task, and the corpus kind they read, is their ``core.families.FamilySpec``'s to say.

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
    counted = "tokens"  # the same in words, for messages
    family: str | None = None  # fine-tuning: the backbone family its head fits
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

    name = "mlm_nsp"
    input_names = ("input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label", "masked_positions")

    def __init__(self, manifest: Any, *, seed: int, probability: float = 0.15, whole_word: bool = False,
                 fixed_shapes: bool = False):
        sp = manifest.special_tokens
        if "mask_token" not in sp:
            raise ConfigError(f"{manifest.root}/manifest.json lists no mask_token among the tokenizer's special tokens; mlm_nsp needs [MASK].")
        self.seed, self.p, self.whole_word = seed, probability, whole_word
        self.mask_id, self.pad_id = sp["mask_token"], sp.get("pad_token", 0)
        self.vocab_size, self.seq_len = manifest.vocab_size, manifest.seq_len
        # data.fixed_shapes: BERT's max_predictions_per_seq (20 at 128 tokens and 15 %) masked-row slots per sequence
        self.fixed_shapes, self.slots_per_seq = fixed_shapes, math.ceil(self.seq_len * probability)
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
        if self.fixed_shapes:
            length = max(self.seq_len, longest)
        padded_labels = _pad(labels, length, -100)
        return {
            "input_ids": _pad(ids, length, self.pad_id),
            "attention_mask": _pad([np.ones(len(x), np.int64) for x in ids], length, 0),
            "token_type_ids": _pad(types, length, 0),
            "labels": padded_labels,
            "masked_positions": self._masked_positions(padded_labels.numpy().reshape(-1), len(samples)),
            "next_sentence_label": torch.tensor([s["next_sentence_label"] for s in samples], dtype=torch.long),
            "keys": [s["key"] for s in samples],
            "num_bad": sum(1 for s in samples if s.get("bad")),
        }

    def _masked_positions(self, flat_labels: np.ndarray, rows: int) -> torch.Tensor:
        """The sparse MLM head's rows as flat indices, counted here on the host (models/bert.py: no device
        read, no graph break). With ``fixed_shapes`` padded to ``slots_per_seq`` per sequence (a multiple of
        that when whole-word masking picks more) by repeating a position whose label is -100: the head
        scores it, the loss ignores it, its gradient is zero."""
        positions = np.flatnonzero(flat_labels != -100)
        if self.fixed_shapes:
            slots = rows * self.slots_per_seq
            slots *= max(1, -(-len(positions) // slots))
            unlabelled = int(np.argmax(flat_labels == -100))  # [CLS] of the first row: special tokens are never masked
            positions = np.concatenate([positions, np.full(slots - len(positions), unlabelled, dtype=positions.dtype)])
        return torch.from_numpy(positions)

    def tokens(self, batch):
        return int(batch["attention_mask"].sum())

    def flops_kwargs(self):
        # the sparse MLM head projects to the vocabulary only at the masked share of positions
        return {"seq_len": self.seq_len, "mlm_fraction": self.p}

    def eval_sums(self, out, batch):
        row_labels = batch["labels"].reshape(-1)[batch["masked_positions"]]  # the sparse MLM head's rows, in order
        scored = row_labels != -100  # all of them unless data.fixed_shapes padded the rows
        n_mlm = float(scored.sum())
        pred = out["masked_prediction_logits"].argmax(-1)
        nsp_pred = out["seq_relationship_logits"].argmax(-1)
        n_nsp = float(batch["next_sentence_label"].numel())
        return {
            "mlm_correct": float(((pred == row_labels) & scored).sum()), "mlm_count": n_mlm,
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

    name = "causal_lm"
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
    """ViT: random-resized-crop + flip (train) / resize + center-crop (eval), optional mixup; top-1.

    Encoded images (png/jpeg) are decoded, cropped, resized and normalised per sample in the loader's
    workers (PIL). Raw-pixel corpora (``images.format: raw``) collate to one uint8 batch plus each
    sample's crop box and flip, drawn from the same per-sample generator; ``forward`` does the resize
    (bilinear ``grid_sample``, the PIL arithmetic), flip, cast, normalisation and mixup on the device,
    so a loader worker only copies bytes (docs/benchmarks.md: ViT-B/16 input cost).

    Evaluation sees what the release's image processor sees on the original image
    (``core.families.vit.eval_view``): encoded images are resized and cropped as it does, raw pixels
    are that view already and are read as they are (no second resize). A corpus whose stored images
    would make the two differ is refused here (``stored_geometry_problem``), so the run's top-1 is
    the release's in ``transformers``.
    """

    name = "image_cls"
    unit, counted = "img", "images"
    input_names = ("pixel_values", "labels")
    mean = std = vit_family.PIXEL_MEAN  # transformers' ViTImageProcessor defaults

    def __init__(self, manifest: Any, *, seed: int, image_size: int, mixup_alpha: float = 0.0,
                 crop_scale: tuple[float, float] = (0.08, 1.0), hflip: bool = True):
        if not manifest.class_map:
            raise ConfigError(f"{manifest.root}/manifest.json has no class_map; image_cls needs labelled images.")
        self.seed, self.size, self.alpha = seed, image_size, mixup_alpha
        self.scale, self.hflip = (float(crop_scale[0]), float(crop_scale[1])), hflip
        self.num_labels = max(manifest.class_map.values()) + 1
        self.class_map = manifest.class_map
        problem = vit_family.stored_geometry_problem(getattr(manifest, "raw", None) or {}, image_size)
        if problem:
            raise DataError(f"{manifest.root}/manifest.json {problem}.")

    def _random_resized_crop(self, w: int, h: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        area = w * h
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
                return (x, y, x + cw, y + ch)
        side = min(w, h)  # fallback: central square
        return ((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2)

    def _flip(self, rng: np.random.Generator) -> bool:
        """Whether a training crop is mirrored (drawn even with ``hflip`` off: the crops stay those of the default)."""
        return bool(rng.random() < 0.5) and self.hflip

    def _view(self, w: int, h: int, rng: np.random.Generator | None) -> tuple[tuple[float, ...], bool]:
        """(crop box in stored pixels, flip) of one raw sample: the region resized to ``size`` (eval: all of
        it, the stored ``eval_view``, which samples every pixel as it is)."""
        if rng is not None:
            box = self._random_resized_crop(w, h, rng)
            return tuple(float(v) for v in box), self._flip(rng)
        return (0.0, 0.0, float(w), float(h)), False

    @staticmethod
    def eval_resize(image_size: int) -> int:
        """Shorter side before the eval centre crop (``core.families.vit.eval_resize``)."""
        return vit_family.eval_resize(image_size)

    @classmethod
    def eval_processor_config(cls, image_size: int) -> dict[str, Any]:
        """``preprocessor_config.json`` that makes ``transformers`` see the pixels our eval sees: the ViT
        family's release file (``core.families.vit.eval_processor_config``; same tensor as ``transform(img, None)``, tested)."""
        return vit_family.eval_processor_config(image_size)

    def transform(self, img, rng: np.random.Generator | None) -> torch.Tensor:
        from PIL import Image

        S = self.size
        if rng is not None:
            img = img.resize((S, S), Image.BILINEAR, box=self._random_resized_crop(*img.size, rng))
            if self._flip(rng):
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:  # transformers' shortest_edge resize + center crop (see eval_processor_config)
            img = vit_family.eval_view(img, S)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - self.mean) / self.std

    def collate(self, samples, *, epoch, train):
        raw = sum(1 for s in samples if "pixels" in s)
        if raw not in (0, len(samples)):
            raise ValueError("a batch mixes raw-pixel and encoded images; blend corpora stored the same way")
        rngs = [_rng(self.seed, s.get("epoch", epoch), s["key"]) if train else None for s in samples]
        labels = torch.tensor([s["label"] for s in samples], dtype=torch.long)
        batch: dict[str, Any] = {"labels": labels, "keys": [s["key"] for s in samples],
                                 "num_bad": sum(1 for s in samples if s.get("bad"))}
        if raw:  # uint8 pixels + where to crop; forward finishes on the device
            views = [self._view(s["pixels"].shape[1], s["pixels"].shape[0], r) for s, r in zip(samples, rngs, strict=True)]
            batch["pixels"] = torch.from_numpy(np.stack([s["pixels"] for s in samples]))
            batch["crop_boxes"] = torch.tensor([v[0] for v in views], dtype=torch.float32)
            batch["flips"] = torch.tensor([v[1] for v in views], dtype=torch.bool)
        else:
            batch["pixel_values"] = torch.stack([self.transform(s["image"], r) for s, r in zip(samples, rngs, strict=True)])
        if train and self.alpha > 0:
            lam = float(_rng(self.seed, samples[0].get("epoch", epoch), samples[0]["key"], "mixup").beta(self.alpha, self.alpha))
            onehot = torch.nn.functional.one_hot(labels, self.num_labels).float()
            batch["labels"] = lam * onehot + (1 - lam) * onehot.roll(1, 0)
            if raw:
                batch["mixup_lambda"] = lam
            else:
                px = batch["pixel_values"]
                batch["pixel_values"] = lam * px + (1 - lam) * px.roll(1, 0)
        return batch

    def pixel_values(self, batch: dict[str, Any]) -> torch.Tensor:
        """The model's input of a batch: collated already (encoded images), or made here on the batch's
        device from raw uint8 pixels, crop boxes and flips (the arithmetic of ``transform``'s PIL bilinear resize)."""
        if "pixel_values" in batch:
            return batch["pixel_values"]
        pixels, boxes = batch["pixels"], batch["crop_boxes"]
        B, H, W, _ = pixels.shape
        x = pixels.permute(0, 3, 1, 2).float()
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        steps = (torch.arange(self.size, device=x.device, dtype=torch.float32) + 0.5) / self.size
        gx = boxes[:, :1] + steps * (boxes[:, 2:3] - boxes[:, :1])  # (B, S) source x of each output column
        gy = boxes[:, 1:2] + steps * (boxes[:, 3:4] - boxes[:, 1:2])
        gx = torch.where(batch["flips"][:, None], gx.flip(1), gx)
        grid = torch.stack([(2 * gx / W - 1)[:, None, :].expand(B, self.size, self.size),
                            (2 * gy / H - 1)[:, :, None].expand(B, self.size, self.size)], dim=-1)
        x = torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
        x = (x / 255.0 - self.mean) / self.std  # python scalars: no host-to-device copy per step
        lam = batch.get("mixup_lambda")
        return x if lam is None else lam * x + (1 - lam) * x.roll(1, 0)

    def model_inputs(self, batch):
        return {"pixel_values": self.pixel_values(batch), "labels": batch["labels"]}

    def tokens(self, batch):
        return int(batch["labels"].shape[0])  # images

    def eval_sums(self, out, batch):
        n = float(batch["labels"].shape[0])
        return {"loss_sum": float(out["loss"]) * n, "count": n,
                "correct": float((out["logits"].argmax(-1) == batch["labels"]).sum())}

    def eval_metrics(self, s):
        return {"loss": s["loss_sum"] / max(s["count"], 1.0), "top1": s["correct"] / max(s["count"], 1.0)}

    def model_overrides(self):
        # the loader always gives RGB (a grey corpus is expanded), so a model of other channels is refused here
        return {"num_labels": self.num_labels, "image_size": self.size, "num_channels": 3}


def _mlm_nsp(cfg, manifest):
    return MLMNSPTask(manifest, seed=cfg.train.seed, probability=cfg.data.mlm_probability, whole_word=cfg.data.whole_word_masking,
                      fixed_shapes=cfg.data.fixed_shapes)


def _causal_lm(cfg, manifest):
    return CausalLMTask(manifest)


def _image_cls(cfg, manifest):
    return ImageClsTask(manifest, seed=cfg.train.seed, image_size=cfg.data.image_size, mixup_alpha=cfg.data.mixup_alpha,
                        crop_scale=tuple(cfg.data.crop_scale), hflip=cfg.data.hflip)

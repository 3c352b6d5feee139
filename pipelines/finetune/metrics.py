"""Downstream-task metrics, implemented from their definitions (no sklearn at run time).

Classification: accuracy, macro-F1 (unweighted mean of per-class F1 over the labels that occur in the
gold or predicted labels, as scikit-learn's ``f1_score(average="macro")``), Matthews correlation
(multi-class form, Gorodkin 2004: MCC = (c·s − Σ_k p_k t_k) / sqrt((s² − Σ p_k²)(s² − Σ t_k²)))
and, for regression, Pearson r and Spearman ρ (Pearson of the ranks, ties averaged).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def accuracy(pred: Sequence[int], gold: Sequence[int]) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean()) if len(gold) else 0.0


def confusion_matrix(pred: Sequence[int], gold: Sequence[int], num_labels: int) -> np.ndarray:
    """cm[t, p] counts examples of true class t predicted as p."""
    cm = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(cm, (np.asarray(gold, dtype=np.int64), np.asarray(pred, dtype=np.int64)), 1)
    return cm


def macro_f1(pred: Sequence[int], gold: Sequence[int], num_labels: int) -> float:
    """Mean over classes of F1 = 2·TP / (2·TP + FP + FN); classes absent from both gold and predictions are left out."""
    return _macro_f1(confusion_matrix(pred, gold, num_labels))


def _macro_f1(cm: np.ndarray) -> float:
    tp = np.diag(cm).astype(float)
    denom = 2 * tp + (cm.sum(0) - tp) + (cm.sum(1) - tp)
    present = denom > 0  # a label neither predicted nor true says nothing about the classifier (sklearn's rule)
    return float((2 * tp[present] / denom[present]).mean()) if present.any() else 0.0


def matthews_corrcoef(pred: Sequence[int], gold: Sequence[int], num_labels: int) -> float:
    """Multi-class MCC from the confusion matrix; 0 when either marginal is constant."""
    return _mcc(confusion_matrix(pred, gold, num_labels))


def _mcc(cm: np.ndarray) -> float:
    cm = cm.astype(float)
    c, s = np.trace(cm), cm.sum()
    p, t = cm.sum(0), cm.sum(1)
    num = c * s - (p * t).sum()
    den = math.sqrt((s * s - (p * p).sum()) * (s * s - (t * t).sum()))
    return float(num / den) if den > 0 else 0.0


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    xc, yc = x - x.mean(), y - y.mean()
    den = math.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float((xc * yc).sum() / den) if den > 0 else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
    """0-based ranks with ties given their average rank, in O(n log n) (one sort, one pass over the runs)."""
    if len(x) == 0:
        return np.zeros(0)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])  # first sorted position of each run of equal values
    ends = np.r_[starts[1:], len(x)]
    run_rank = (starts + ends - 1) / 2.0  # mean of the positions start..end-1
    ranks = np.empty(len(x), dtype=float)
    ranks[order] = np.repeat(run_rank, ends - starts)
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return pearson(_ranks(np.asarray(x, dtype=float)), _ranks(np.asarray(y, dtype=float)))


def metrics_from_confusion(cm: np.ndarray) -> dict[str, float]:
    """Accuracy, macro-F1 and MCC from a confusion matrix (additive across batches and ranks)."""
    total = cm.sum()
    return {
        "accuracy": float(np.trace(cm) / total) if total else 0.0,
        "macro_f1": _macro_f1(cm),
        "mcc": _mcc(cm),
    }


def classification_metrics(pred: Sequence[int], gold: Sequence[int], num_labels: int) -> dict[str, float]:
    return metrics_from_confusion(confusion_matrix(pred, gold, num_labels))


def regression_metrics(pred: Sequence[float], gold: Sequence[float]) -> dict[str, float]:
    pred_a, gold_a = np.asarray(pred, dtype=float), np.asarray(gold, dtype=float)
    return {
        "mse": float(((pred_a - gold_a) ** 2).mean()) if len(gold_a) else 0.0,
        "pearson": pearson(pred_a, gold_a),
        "spearman": spearman(pred_a, gold_a),
    }

"""Task metrics against scikit-learn / scipy-free hand computations and sklearn when present."""

import numpy as np
import pytest

from pipelines.finetune.metrics import accuracy, classification_metrics, macro_f1, matthews_corrcoef, pearson, spearman

sklearn_metrics = pytest.importorskip("sklearn.metrics")


def test_against_sklearn_on_random_labels():
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 4, size=300)
    pred = np.where(rng.random(300) < 0.6, gold, rng.integers(0, 4, size=300))
    assert accuracy(pred, gold) == pytest.approx(sklearn_metrics.accuracy_score(gold, pred))
    assert macro_f1(pred, gold, 4) == pytest.approx(sklearn_metrics.f1_score(gold, pred, average="macro"))
    assert matthews_corrcoef(pred, gold, 4) == pytest.approx(sklearn_metrics.matthews_corrcoef(gold, pred))


def test_hand_counted_binary_case():
    gold = [1, 1, 0, 0, 1]
    pred = [1, 0, 0, 1, 1]
    # TP=2 FP=1 FN=1 TN=1: F1(1)=4/6, F1(0)=2/4, MCC=(2*1-1*1)/sqrt(3*3*2*2)=1/6
    m = classification_metrics(pred, gold, 2)
    assert m["accuracy"] == pytest.approx(0.6)
    assert m["macro_f1"] == pytest.approx((4 / 6 + 0.5) / 2)
    assert m["mcc"] == pytest.approx(1 / 6)


def test_constant_prediction_has_zero_mcc():
    assert matthews_corrcoef([0, 0, 0], [0, 1, 2], 3) == 0.0


def test_correlations():
    x = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert pearson(x, [2 * v + 1 for v in x]) == pytest.approx(1.0)
    assert spearman(x, [v**3 for v in x]) == pytest.approx(1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # ties averaged


def test_macro_f1_leaves_out_labels_absent_from_gold_and_predictions():
    # 3 labels declared, only 0 and 1 occur, all right: sklearn gives 1.0 (the old mean over 3 labels gave 0.667)
    gold = pred = [0, 1, 0, 1]
    assert macro_f1(pred, gold, 3) == pytest.approx(sklearn_metrics.f1_score(gold, pred, average="macro")) == 1.0
    rng = np.random.default_rng(1)
    gold = rng.integers(0, 3, size=200)  # label 3 and 4 never occur
    pred = np.where(rng.random(200) < 0.5, gold, rng.integers(0, 4, size=200))  # 3 is predicted, 4 never
    assert classification_metrics(pred, gold, 5)["macro_f1"] == pytest.approx(sklearn_metrics.f1_score(gold, pred, average="macro"))


def test_spearman_matches_scipy_with_many_ties_and_scales():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(2)
    for n, levels in ((50, 5), (2000, 40), (200_000, 100_000)):
        x = rng.integers(0, levels, size=n).astype(float)
        y = x + rng.normal(0, levels / 3, size=n).round()
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)

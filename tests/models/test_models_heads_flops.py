"""Fine-tuning heads on a pretrained encoder, and the FLOP count against a hand count."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY_TEXT, TINY_VIT, text_batch

import models
from models.flops import training_flops_per_sample, training_flops_per_token


def test_classifier_shares_the_pretrained_encoder():
    bert = models.create("bert-tiny", **TINY_TEXT)
    clf = models.SequenceClassifier.from_pretrained_encoder(bert, 3)
    assert clf.backbone is bert.bert and clf.family == "bert" and clf.config.hidden_size == 32
    ids, mask, types = text_batch()
    clf.eval()  # also puts the shared encoder in eval mode
    pooled = bert.bert(ids, mask, types)["pooler_output"]
    assert torch.allclose(clf(ids, mask, types)["logits"], clf.classifier(pooled), atol=1e-6)


def test_classifier_loss_kinds():
    clf = models.SequenceClassifier(models.create("bert-tiny", **TINY_TEXT).bert, 3).eval()
    ids, mask, types = text_batch()
    out = clf(ids, mask, types, labels=torch.tensor([0, 2]))
    assert torch.allclose(out["loss"], F.cross_entropy(out["logits"], torch.tensor([0, 2])))
    multi = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    out = clf(ids, mask, types, labels=multi)
    assert torch.allclose(out["loss"], F.binary_cross_entropy_with_logits(out["logits"], multi))
    reg = models.SequenceClassifier(models.create("bert-tiny", **TINY_TEXT).bert, 1).eval()
    out = reg(ids, mask, types, labels=torch.tensor([0.5, 2.0]))
    assert torch.allclose(out["loss"], F.mse_loss(out["logits"].squeeze(-1), torch.tensor([0.5, 2.0])))
    with pytest.raises(ValueError, match="id2label"):
        models.SequenceClassifier(reg.backbone, 2, id2label={0: "a"})


def test_qa_head_spans_and_ignored_positions():
    qa = models.QuestionAnswering.from_pretrained_encoder(models.create("bert-tiny", **TINY_TEXT)).eval()
    ids, mask, types = text_batch()
    out = qa(ids, mask, types, start_positions=torch.tensor([1, 99]), end_positions=torch.tensor([2, 99]))
    assert out["start_logits"].shape == out["end_logits"].shape == (2, 8)
    want = (
        F.cross_entropy(out["start_logits"][:1], torch.tensor([1]))
        + F.cross_entropy(out["end_logits"][:1], torch.tensor([2]))
    ) / 2
    assert torch.allclose(out["loss"], want)  # the out-of-range example is ignored


def test_checkpointing_toggle_reaches_through_heads():
    clf = models.SequenceClassifier.from_pretrained_encoder(models.create("bert-tiny", **TINY_TEXT), 2)
    clf.set_activation_checkpointing(True)
    assert all(b.checkpointing for b in clf.backbone.blocks)


def test_bert_flops_hand_count():
    cfg = models.get_config("bert-tiny", vocab_size=100, num_layers=2, hidden_size=8, intermediate_size=32, num_heads=2)
    T, L, d, f, V = 10, 2, 8, 32, 100
    block = 4 * d * d + 2 * d * f  # 256 + 512 = 768 per layer
    assert block == 768
    per_token_params = L * block + d * d + d * V  # blocks + MLM transform + decoder = 1536 + 64 + 800
    assert per_token_params == 2400
    per_sequence_params = d * d + 2 * d  # pooler + NSP = 80
    attention = 12 * L * d * T
    assert attention == 1920
    hand = 6 * per_token_params + 6 * per_sequence_params / T + attention  # = 14400 + 48 + 1920
    assert training_flops_per_token(cfg, T) == pytest.approx(hand) == pytest.approx(16368)
    assert training_flops_per_sample(cfg, T) == pytest.approx(16368 * 10)
    assert per_sequence_params == 80
    # sparse MLM head at 15 % of positions: the head's 864 params count 0.15 times
    assert training_flops_per_token(cfg, T, mlm_fraction=0.15) == pytest.approx(16368 - 6 * 0.85 * 864)


def test_gpt_and_vit_flops_hand_count():
    gpt = models.get_config("gpt-tiny", vocab_size=50, num_layers=1, hidden_size=4, num_heads=1, intermediate_size=16)
    # 6 * (4*16 + 2*4*16 + 4*50) + 12*1*4*T  with T = 8
    assert training_flops_per_token(gpt, 8) == pytest.approx(6 * (64 + 128 + 200) + 384)
    vit = models.get_config(
        "vit-tiny", **dict(TINY_VIT, num_layers=1, hidden_size=4, num_heads=1, intermediate_size=16)
    )
    P, T = 4, 5  # 8x8 image, patch 4 -> 2x2 patches + [CLS]
    hand = 6 * (P * 3 * 16 * 4 + T * (64 + 128) + 4 * 3) + 12 * 1 * 4 * T * T
    assert training_flops_per_token(vit) == pytest.approx(hand) == pytest.approx(6 * (768 + 960 + 12) + 1200)


def test_flops_close_to_6n_for_gpt2_small():
    """Sanity against the usual 6N rule: attention adds 12 L d T, ~1/7 of 6N at T=1024 for GPT-2 small."""
    cfg = models.get_config("gpt2-small")
    n_non_embedding = 12 * (4 * 768**2 + 2 * 768 * 3072)
    flops = training_flops_per_token(cfg, 1024)
    assert flops == 6 * (n_non_embedding + 768 * 50257) + 12 * 12 * 768 * 1024

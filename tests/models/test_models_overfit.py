"""Each family memorizes one fixed batch — post-LN, pre-LN and T-Fixup variants alike."""

import pytest
import torch
from tiny_models import TINY_TEXT, TINY_VIT

import models

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)


def fit(model, batch, steps, lr):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    first = None
    for _ in range(steps):
        loss = model(**batch)["loss"]
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return first, model(**batch)["loss"].item()


def bert_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 64, (4, 12), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, [2, 5, 9]] = ids[:, [2, 5, 9]]
    ids[:, [2, 5, 9]] = 4  # [MASK]
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types, labels=labels,
                next_sentence_label=torch.tensor([0, 1, 1, 0]))  # fmt: skip


def gpt_batch():
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(0, 64, (4, 13), generator=g)
    return dict(input_ids=seq[:, :-1], labels=seq[:, 1:])


def vit_batch():
    g = torch.Generator().manual_seed(3)
    return dict(pixel_values=torch.randn(6, 3, 8, 8, generator=g), labels=torch.tensor([0, 1, 2, 0, 1, 2]))


VARIANTS = [{"norm_placement": "pre"}, {"norm_placement": "post"}, {"init": "t-fixup"}]


@pytest.mark.parametrize("variant", VARIANTS, ids=["pre-ln", "post-ln", "t-fixup"])
@pytest.mark.parametrize(
    "name,batch,over",
    [("bert-tiny", bert_batch, TINY_TEXT), ("gpt-tiny", gpt_batch, TINY_TEXT), ("vit-tiny", vit_batch, TINY_VIT)],
    ids=["bert", "gpt", "vit"],
)
def test_overfits_one_batch(name, batch, over, variant):
    model = models.create(name, **over, **NO_DROPOUT, **variant)
    first, last = fit(model, batch(), steps=200, lr=3e-3)
    assert first > 20 * last
    assert last < 0.05, f"{name} {variant}: loss {first:.3f} -> {last:.4f}"

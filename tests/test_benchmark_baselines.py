"""Issue #30's plain-loop ViT baseline (benchmarks/plain_vit.py) computes what our ViT computes, so the bare
step's "ours / plain loop" measures how the model is written, not a different model."""

import re

import torch

import models
from benchmarks.plain_vit import PlainViT

# our ViT's parameter names -> the plain loop's
_RENAMES = [(r"^patch_embed\.", "patch."), (r"^cls_token$", "cls"), (r"^pos_embed$", "pos"), (r"^norm\.", "ln_f."),
            (r"\.attn\.qkv\.", ".qkv."), (r"\.attn\.proj\.", ".out."), (r"\.mlp\.fc1\.", ".up."),
            (r"\.mlp\.fc2\.", ".down."), (r"\.norm1\.", ".ln1."), (r"\.norm2\.", ".ln2.")]


def _plain_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def test_the_plain_vit_is_our_vit_written_plainly():
    ours = models.create("vit-tiny", num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64, image_size=32,
                         patch_size=8, num_labels=5, hidden_dropout=0.1)
    with torch.no_grad():  # weights of a trained size (the init's 0.02 would hide an other GELU or LayerNorm eps)
        for p in ours.parameters():
            p.normal_(0.0, 0.5)
    plain = PlainViT.like(ours.config)
    theirs = dict(plain.named_parameters())
    assert sorted(map(_plain_name, dict(ours.named_parameters()))) == sorted(theirs)  # the same weights, all of them
    plain.load_state_dict({_plain_name(k): v for k, v in ours.state_dict().items()})
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 4, 2, 2])
    ours.eval(), plain.eval()  # dropout off: the same function
    torch.testing.assert_close(plain(images, labels)["loss"], ours(images, labels)["loss"], rtol=1e-5, atol=1e-5)
    # and the recipe's dropout, in training, as often in one forward (after the embedding, on each sublayer's output)
    calls = {}
    for label, model in (("ours", ours), ("plain", plain)):
        model.train()
        rates = []
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.register_forward_hook(lambda mod, args, out, rates=rates: rates.append(mod.p))
        model(images, labels)
        calls[label] = rates
    assert calls["plain"] == calls["ours"] == [0.1] * (1 + 2 * 2)

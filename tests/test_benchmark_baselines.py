"""Issue #30's plain-loop ViT baseline (benchmarks/plain_vit.py) computes what our ViT computes, so the bare
step's "ours / plain loop" measures how the model is written, not a different model."""

import contextlib
import re

import torch
import torch.nn.functional as F

import models
from benchmarks.plain_bert import PlainBERT
from benchmarks.plain_vit import PlainViT

# our ViT's parameter names -> the plain loop's
_RENAMES = [(r"^patch_embed\.", "patch."), (r"^cls_token$", "cls"), (r"^pos_embed$", "pos"), (r"^norm\.", "ln_f."),
            (r"\.attn\.qkv\.", ".qkv."), (r"\.attn\.proj\.", ".out."), (r"\.mlp\.fc1\.", ".up."),
            (r"\.mlp\.fc2\.", ".down."), (r"\.norm1\.", ".ln1."), (r"\.norm2\.", ".ln2.")]


def _plain_name(name: str, renames: list[tuple[str, str]] = _RENAMES) -> str:
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


@contextlib.contextmanager
def _sdpa_dropout_rates():
    """The dropout rate of every ``scaled_dot_product_attention`` call inside the block (both models call it through
    ``torch.nn.functional``)."""
    rates, sdpa = [], F.scaled_dot_product_attention

    def counted(*args, dropout_p=0.0, **kwargs):
        rates.append(dropout_p)
        return sdpa(*args, dropout_p=dropout_p, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        yield rates
    finally:
        F.scaled_dot_product_attention = sdpa


def _dropout_calls(ours: torch.nn.Module, plain: torch.nn.Module, *inputs, **batch) -> dict[str, tuple[list, list]]:
    """Per model, in one training forward: the rate of every ``nn.Dropout`` call and the dropout of every attention
    call, in order."""
    calls = {}
    for label, model in (("ours", ours), ("plain", plain)):
        model.train()
        rates = []
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.register_forward_hook(lambda mod, args, out, rates=rates: rates.append(mod.p))
        with _sdpa_dropout_rates() as attention:
            model(*inputs, **batch)
        calls[label] = (rates, attention)
    return calls


def _trained_size_(model: torch.nn.Module) -> torch.nn.Module:
    """Weights of a trained size: the init's 0.02 would hide another GELU form or LayerNorm eps."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def test_the_plain_vit_is_our_vit_written_plainly():
    ours = _trained_size_(models.create("vit-tiny", num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64,
                                        image_size=32, patch_size=8, num_labels=5, hidden_dropout=0.1))
    plain = PlainViT.like(ours.config)
    theirs = dict(plain.named_parameters())
    assert sorted(map(_plain_name, dict(ours.named_parameters()))) == sorted(theirs)  # the same weights, all of them
    plain.load_state_dict({_plain_name(k): v for k, v in ours.state_dict().items()})
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 4, 2, 2])
    ours.eval(), plain.eval()  # dropout off: the same function
    torch.testing.assert_close(plain(images, labels)["loss"], ours(images, labels)["loss"], rtol=1e-5, atol=1e-5)
    # and the recipe's dropout, in training, as often in one forward (after the embedding, on each sublayer's output;
    # none inside attention)
    calls = _dropout_calls(ours, plain, images, labels)
    assert calls["plain"] == calls["ours"] == ([0.1] * (1 + 2 * 2), [0.0] * 2)


# our BERT's parameter names -> the plain loop's
_BERT_RENAMES = [(r"^bert\.embeddings\.word_embeddings\.", "tok."), (r"^bert\.embeddings\.position_embeddings\.", "pos."),
                 (r"^bert\.embeddings\.token_type_embeddings\.", "seg."), (r"^bert\.embeddings\.norm\.", "ln_emb."),
                 (r"^bert\.pooler\.", "pool."), (r"^mlm\.dense\.", "transform."), (r"^mlm\.norm\.", "ln_head."),
                 (r"^mlm\.decoder\.bias$", "decoder_bias"), (r"^bert\.blocks\.", "blocks.")] + _RENAMES


def _bert_batch(vocab: int, batch: int = 4, seq: int = 12) -> dict[str, torch.Tensor]:
    """An MLM + NSP batch as the loader makes it: sentence pairs, padding at the end of two of them, 15 % masked."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    lengths = torch.tensor([seq, seq - 3, seq, seq - 5])
    attention = (torch.arange(seq)[None] < lengths[:, None]).long()
    ids = ids * attention  # the pad id 0
    segments = (torch.arange(seq)[None] >= (lengths[:, None] // 2)).long() * attention
    masked = (torch.rand(batch, seq, generator=g) < 0.15) & attention.bool()
    masked[0, 1] = True
    return {"input_ids": ids, "token_type_ids": segments, "attention_mask": attention,
            "labels": torch.where(masked, ids, -100), "masked_positions": masked.flatten().nonzero()[:, 0],
            "next_sentence_label": torch.tensor([0, 1, 1, 0])}


def test_the_plain_bert_is_our_bert_written_plainly():
    torch.manual_seed(0)
    ours = _trained_size_(models.create("bert-tiny", num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64,
                                        vocab_size=50, max_position_embeddings=16))
    plain = PlainBERT.like(ours.config)
    theirs = dict(plain.named_parameters())
    renamed = [_plain_name(k, _BERT_RENAMES) for k in dict(ours.named_parameters())]
    assert sorted(renamed) == sorted(theirs)  # the same weights, all of them (the decoder tied to the embedding in both)
    plain.load_state_dict({_plain_name(k, _BERT_RENAMES): v for k, v in ours.state_dict().items()
                           if k != "mlm.decoder.weight"})
    batch = _bert_batch(50)
    ours.eval(), plain.eval()  # dropout off: the same function, padding masked in attention (the same float32
    # operations in the same order: equal to the last bits, where GELU's tanh form moves the loss by ~1e-4)
    torch.testing.assert_close(plain(**batch)["loss"], ours(**batch)["loss"], rtol=1e-6, atol=1e-6)
    # the recipe's dropout, in training, as often in one forward: after the embedding and on each sublayer's output
    # (nn.Dropout), and inside attention at the same rate
    calls = _dropout_calls(ours, plain, **batch)
    assert calls["plain"] == calls["ours"] == ([0.1] * (1 + 2 * 2), [0.1] * 2)

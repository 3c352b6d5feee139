"""Tiny sizes shared by the model tests (seconds on a shared 2-core CPU)."""

import torch

TINY = dict(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64)
TINY_TEXT = dict(TINY, vocab_size=64, max_position_embeddings=16)
TINY_VIT = dict(TINY, image_size=8, patch_size=4, num_labels=3)


def tiny_overrides(name: str) -> dict:
    return dict(TINY_VIT) if name.startswith("vit") else dict(TINY_TEXT)


def text_batch(batch: int = 2, seq: int = 8, vocab: int = 64, pad_from: int | None = 5):
    """Random ids, a padding mask (row 1 padded from ``pad_from``) and A/B token types."""
    ids = torch.randint(1, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_from is not None:
        mask[1, pad_from:] = 0
        ids[1, pad_from:] = 0
    types = torch.zeros(batch, seq, dtype=torch.long)
    types[:, seq // 2 :] = 1
    return ids, mask, types

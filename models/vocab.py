"""Vocabulary padding: a training detail that never reaches a release.

A token embedding / LM head whose row count is a multiple of 64 keeps the vocabulary matmul (the
largest one of GPT-2 small: [B*T, 768] x [768, 50257]) on aligned tensor-core tiles; nanoGPT pads
50,257 to 50,304 for the same reason. With ``pad_vocab_multiple = m`` a model allocates
``padded_vocab_size(V, m)`` rows, the extra rows start at zero and the model slices its logits to the
true ``V`` before the loss, ``argmax`` and sampling, so a padded row never receives a gradient (it
stays exactly zero) and never wins. The models build and initialize their ``V`` rows first and pad
afterwards (``pad_vocab_rows_``), so a padded model starts from the unpadded one's exact weights and
draws the same random numbers: padding changes the speed, not what a run computes. ``config.vocab_size`` is always the tokenizer's ``V``; export
(``models.hf.to_hf``) keeps the first ``V`` rows and import pads them again (``from_hf(...,
pad_vocab_multiple=m)``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from core.families.transformer import check_pad_multiple, padded_vocab_size

__all__ = ["padded_vocab_size", "is_vocab_key", "unpad_vocab", "pad_vocab", "pad_vocab_rows_", "check_pad_multiple"]

# Parameters with one row per token: token embeddings, the (tied) LM head / MLM decoder and its bias.
_VOCAB_KEY = re.compile(r"(^|\.)(wte\.weight|lm_head\.weight|word_embeddings\.weight|mlm\.decoder\.(weight|bias))$")


def is_vocab_key(key: str) -> bool:
    """Whether state-dict entry ``key`` has one row per token (and so may be padded)."""
    return bool(_VOCAB_KEY.search(key))


def unpad_vocab(key: str, tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The first ``vocab_size`` rows of a vocabulary tensor (other tensors unchanged): what a release holds."""
    return tensor[:vocab_size] if is_vocab_key(key) and tensor.shape[0] > vocab_size else tensor


def pad_vocab(key: str, tensor: torch.Tensor, vocab_size: int, rows: int) -> torch.Tensor:
    """A ``vocab_size``-row vocabulary tensor grown to ``rows`` rows with zeros: what a padded model holds.

    Any other tensor (another key, or another row count, which the caller's shape check reports) is unchanged.
    """
    if not is_vocab_key(key) or tensor.shape[0] != vocab_size or rows <= vocab_size:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


@torch.no_grad()
def pad_vocab_rows_(module: nn.Embedding | nn.Linear, vocab_size: int, rows: int) -> None:
    """Give ``module`` (a token embedding or vocabulary projection) ``rows`` rows, those past ``vocab_size`` zero.

    A ``vocab_size``-row module grows (new Parameters; call before handing the model to an optimizer),
    an already padded one has its padding rows zeroed again (after a re-initialization).
    """
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if p is None:
            continue
        if p.shape[0] < rows:
            grown = torch.cat([p.detach(), p.new_zeros((rows - p.shape[0], *p.shape[1:]))])
            setattr(module, name, nn.Parameter(grown, requires_grad=p.requires_grad))
        else:
            p[vocab_size:].zero_()
    if isinstance(module, nn.Embedding):
        module.num_embeddings = rows
    elif isinstance(module, nn.Linear):
        module.out_features = rows

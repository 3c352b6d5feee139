"""BERT (Devlin et al. 2019), torch-free half: config, named sizes, MLM+NSP FLOPs, HF ``bert``.

The module is ``models.bert.BertForPreTraining``; the FLOPs conventions are in ``models.flops``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .spec import FamilySpec, register_family
from .transformer import TransformerConfig, attention_flops, block_matmul_params, check_pad_multiple, padded_vocab_size

__all__ = ["BertConfig", "SPEC", "bert_training_flops"]


@dataclass(kw_only=True)
class BertConfig(TransformerConfig):
    """BERT sizes and variants; defaults are BERT-base (uncased vocabulary)."""

    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # segments A/B
    pad_token_id: int | None = 0  # the embedding's padding_idx (no gradient); None: none, as transformers reads null
    position_embedding: Literal["learned", "sinusoidal"] = "learned"
    pad_vocab_multiple: int = 1  # embedding/MLM-decoder rows rounded up to this (models.vocab); 64 on GPUs

    def __post_init__(self) -> None:
        super().__post_init__()
        check_pad_multiple(self.pad_vocab_multiple)
        if self.position_embedding not in ("learned", "sinusoidal"):
            raise ValueError(f"position_embedding must be 'learned' or 'sinusoidal', got {self.position_embedding!r}.")

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.pad_vocab_multiple)


def bert_training_flops(config: BertConfig, seq_len: int, include_head: bool = True, mlm_fraction: float = 1.0) -> float:
    """Per token: 6 [N_blocks + f (d^2 + d V)] + 6 (d^2 + 2 d) / T + 12 L d T (MLM at share f, pooler + NSP per sequence)."""
    d = config.hidden_size
    n = block_matmul_params(config)
    per_sequence = 0
    if include_head:
        n += mlm_fraction * (d * d + d * config.vocab_size)
        per_sequence = d * d + 2 * d
    return 6 * n + 6 * per_sequence / seq_len + attention_flops(config, seq_len)


def _usage(path: str) -> str:
    return f"""```python
from transformers import pipeline

fill = pipeline("fill-mask", model="{path}")
print(fill("the [MASK] statement"))
```

This is a `BertForPreTraining` checkpoint: the encoder, the MLM head, and the pooler + next-sentence
head that `AutoModelForSequenceClassification` starts its classifier from (as Google's BERT
checkpoints are). `AutoModelForMaskedLM` and `pipeline("fill-mask")` load it as `BertForMaskedLM`,
which has no pooler or NSP head, so transformers lists those 4 tensors (`bert.pooler.dense.*`,
`cls.seq_relationship.*`) as UNEXPECTED: expected, nothing the MLM needs is missing. Load it as
`BertForPreTraining` for both heads, or fine-tune it with `pretrain finetune` or
`AutoModelForSequenceClassification` / `AutoModelForQuestionAnswering`.
"""


# Turc et al. 2019 ("Well-Read Students Learn Better") sizes; base/large from Devlin et al.
_SIZES = {"tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "base": (12, 768), "large": (24, 1024)}

SPEC = register_family(FamilySpec(
    name="bert", config_class=BertConfig,
    sizes={f"bert-{name}": dict(num_layers=layers, hidden_size=width, num_heads=width // 64, intermediate_size=4 * width)
           for name, (layers, width) in _SIZES.items()},
    tasks=("mlm_nsp",), corpus_kind="bert_pairs", flops=bert_training_flops, flops_unit="token",
    hf_model_type="bert", card_usage=_usage,
))

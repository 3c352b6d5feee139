"""GPT-2 (Radford et al. 2019), torch-free half: config, named sizes, causal-LM FLOPs, HF ``gpt2``.

The module is ``models.gpt.GPT``; the FLOPs conventions are in ``models.flops``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .spec import FamilySpec, register_family
from .transformer import TransformerConfig, attention_flops, block_matmul_params, check_pad_multiple, padded_vocab_size

__all__ = ["GPTConfig", "SPEC", "gpt_training_flops"]


@dataclass(kw_only=True)
class GPTConfig(TransformerConfig):
    """GPT-2 sizes and variants; defaults are GPT-2 small (124M)."""

    vocab_size: int = 50257
    max_position_embeddings: int = 1024  # context length n_ctx
    position_embedding: Literal["learned", "sinusoidal"] = "learned"
    tie_word_embeddings: bool = True
    activation: Literal["gelu", "gelu_tanh"] = "gelu_tanh"
    layer_norm_eps: float = 1e-5
    norm_placement: Literal["post", "pre"] = "pre"
    pad_vocab_multiple: int = 1  # embedding/LM-head rows rounded up to this (models.vocab); 64 on GPUs
    # Training loss over chunks of this many positions, each chunk's logits recomputed in backward
    # (``models.gpt.chunked_lm_loss``): no [B*T, V] logits held; 0 = one cross-entropy over the batch.
    loss_chunk_tokens: int = 0
    # A training forward with labels (grad enabled) also returns the logits. False returns the loss only: a
    # compiled model's backward then takes no [B, T, V] zero gradient for logits the step never uses.
    train_logits: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_pad_multiple(self.pad_vocab_multiple)
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0 (0 = off), got {self.loss_chunk_tokens}.")
        if self.position_embedding not in ("learned", "sinusoidal"):
            raise ValueError(f"position_embedding must be 'learned' or 'sinusoidal', got {self.position_embedding!r}.")

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.pad_vocab_multiple)


def gpt_training_flops(config: GPTConfig, seq_len: int, include_head: bool = True, mlm_fraction: float = 1.0) -> float:
    """Per token: 6 [N_blocks + d V] + 12 L d T (the tied LM head at every position)."""
    n = block_matmul_params(config)
    if include_head:
        n += config.hidden_size * config.vocab_size
    return float(6 * n + attention_flops(config, seq_len))


def _usage(path: str) -> str:
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{path}")
model = AutoModelForCausalLM.from_pretrained("{path}")
inputs = tokenizer("the", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))
```

Several prompts at once: a tokenizer without a pad token (as `pretrain prepare` trains them) needs
`tokenizer.pad_token = tokenizer.eos_token` and `tokenizer.padding_side = "left"` before
`tokenizer([...], padding=True)`, so that generation continues each prompt from its last token.
"""


_SIZES = {f"gpt2-{name}": dict(num_layers=layers, hidden_size=width, num_heads=width // 64, intermediate_size=4 * width)
          for name, (layers, width) in {"small": (12, 768), "medium": (24, 1024), "large": (36, 1280)}.items()}

SPEC = register_family(FamilySpec(
    name="gpt", config_class=GPTConfig,
    sizes={
        "gpt-tiny": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
        **_SIZES,
        # GPT-3 XL (Brown et al. 2020, Table 2.1: 1.3B, 24 layers, d_model 2048, context 2048). The table's
        # 24 heads x d_head 128 do not multiply to 2048; 16 heads of 128 is the shape open reproductions use.
        "gpt3-xl": dict(num_layers=24, hidden_size=2048, num_heads=16, intermediate_size=8192, max_position_embeddings=2048),
    },
    tasks=("causal_lm",), corpus_kind="packed_lm", flops=gpt_training_flops, flops_unit="token",
    hf_model_type="gpt2", card_usage=_usage,
))

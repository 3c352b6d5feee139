"""benchmarks/attention_backends.py times the attention each GPU recipe really makes, and says why a kernel refuses it."""

import torch

from benchmarks.attention_backends import Attention, compare, format_rows, recipe_attention


def test_each_recipes_attention_is_read_from_its_config():
    assert recipe_attention("gpt") == Attention(batch=16, heads=12, seq=1024, head_dim=64, causal=True, padding_mask=False,
                                                dropout=0.0)
    # BERT phase 1 on one GPU: its global batch of 256 as one micro-batch, padded pairs, BERT's attention dropout
    assert recipe_attention("bert") == Attention(batch=256, heads=12, seq=128, head_dim=64, causal=False, padding_mask=True,
                                                 dropout=0.1)
    assert recipe_attention("bert", ["data.micro_batch_size=32"]).batch == 32  # what each of 8 GPUs runs
    assert recipe_attention("vit") == Attention(batch=128, heads=12, seq=197, head_dim=64, causal=False, padding_mask=False,
                                                dropout=0.0)


def test_the_table_names_the_pick_and_each_refusal_with_its_reason():
    rows = [compare(r, torch.device("cpu"), torch.float32, batch=2, steps=1, warmup=0) for r in ("bert", "vit")]
    bert, vit = rows
    assert bert["default"] == "math" and vit["default"] == "flash"  # the CPU's selector: flash refuses dropout
    assert isinstance(vit["ms"]["flash"], float) and vit["ms"]["flash"] == vit["ms"]["default"]
    assert "dropout" in bert["ms"]["flash"]  # torch's own words for why
    table = format_rows(rows)
    assert "| bert | 2 x 12 heads x 128 x 64, padding mask, dropout 0.1 | math: " in table
    assert "- bert, flash refuses: " in table and "| vit | 2 x 12 heads x 197 x 64 | flash: " in table

"""Exported releases behave as users expect from ``transformers``: a GPT release stops generating at
the tokenizer's end of text, and every special id in its config is the tokenizer's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT = "the cat sat on the mat."


def _gpt_checkpoint(root: Path, steps: int = 15) -> Path:
    """A DDP-engine checkpoint of a tiny GPT taught that TEXT is followed by end of text, with its BPE tokenizer."""
    import models
    from data_prep.config import TokenizerConfig
    from data_prep.tokenizer import GPT_EOS, save_tokenizer, train_tokenizer

    corpus = [TEXT, "a dog ran in the park.", "the sun is hot today.", "we read a book at night."] * 20
    tok = train_tokenizer(corpus, TokenizerConfig(type="bpe", vocab_size=300, min_frequency=2))
    ckpt = root / f"step-{steps:08d}"
    save_tokenizer(tok, ckpt / "tokenizer", "bpe", model_max_length=64, lowercase=False)
    eos = tok.token_to_id(GPT_EOS)
    assert eos == 0  # our byte-level BPE puts <|endoftext|> first (the old export assumed vocab_size - 1)
    ids = torch.tensor([tok.encode(TEXT).ids + [eos]])
    torch.manual_seed(0)
    overrides = {"vocab_size": tok.get_vocab_size(), "max_position_embeddings": 64,
                 "num_layers": 1, "hidden_size": 64, "intermediate_size": 128}
    model = models.create("gpt-tiny", **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(ids[:, :-1], labels=ids[:, 1:])["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    (ckpt / "engine").mkdir(parents=True)
    torch.save(model.state_dict(), ckpt / "engine" / "model.pt")
    state = {"step": steps, "task": "causal_lm", "engine": "ddp", "zero_stage": 0,
             "model_build": {"name": "gpt-tiny", "overrides": overrides}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return ckpt


def test_gpt_release_generate_stops_at_end_of_text_with_default_arguments(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from pipelines.engine.export import export_checkpoint

    out = export_checkpoint(_gpt_checkpoint(tmp_path), tmp_path / "release")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert tok.eos_token == "<|endoftext|>"

    prompt = tok("the cat sat", return_tensors="pt")
    gen = model.generate(**prompt, max_new_tokens=20, do_sample=False)[0].tolist()
    assert gen[-1] == tok.eos_token_id, tok.decode(gen)
    assert len(gen) < prompt["input_ids"].shape[1] + 20  # stopped, not cut off by max_new_tokens
    assert tok.decode(gen, skip_special_tokens=True) == TEXT
    cfg = json.loads((out / "config.json").read_text())
    gen_cfg = GenerationConfig.from_pretrained(out)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert cfg.get(name) == getattr(tok, name), name
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(gen_cfg, name) == getattr(tok, name), name

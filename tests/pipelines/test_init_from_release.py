"""``model.init_from`` a release: continued pretraining from `pretrain export`'s directory or a transformers GPT-2."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY = "model.overrides={hidden_size: 32, num_heads: 2, intermediate_size: 128, num_layers: 2, max_position_embeddings: 64}"


def _gpt2_dir(tmp_path: Path, vocab: int = 120) -> tuple[Path, torch.nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    hf.save_pretrained(tmp_path / "gpt2")  # made by transformers itself, as an outside checkpoint is
    return tmp_path / "gpt2", hf


@pytest.mark.parametrize("pad", [1, 64])
def test_init_from_a_transformers_gpt2_directory_starts_from_its_weights(tmp_path, pad):
    from pipelines.engine.config import load_run_config
    from pipelines.engine.model_build import build_model

    release, hf = _gpt2_dir(tmp_path)
    task = SimpleNamespace(name="causal_lm", family="gpt", seq_len=32, model_overrides=lambda: {"vocab_size": 120})
    cfg = load_run_config(REPO / "configs/train/gpt_tiny_cpu.yaml",
                          [f"model.init_from={release}", TINY, f"model.pad_vocab_multiple={pad}"])
    model, _ = build_model(cfg, task)  # before: "... is neither a checkpoint nor a run directory", exit 2
    ids = torch.randint(0, 120, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids)["logits"], hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_init_from_a_release_of_another_vocabulary_names_its_tokenizer(tmp_path):
    from core.config import ConfigError
    from pipelines.engine.config import load_run_config
    from pipelines.engine.model_build import build_model

    release, _ = _gpt2_dir(tmp_path, vocab=100)
    task = SimpleNamespace(name="causal_lm", family="gpt", seq_len=32, model_overrides=lambda: {"vocab_size": 120})
    cfg = load_run_config(REPO / "configs/train/gpt_tiny_cpu.yaml", [f"model.init_from={release}", TINY])
    with pytest.raises(ConfigError, match=f"size mismatch.*tokenizer.path={release}"):
        build_model(cfg, task)
    (release / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=f"model.init_from={release}: not a usable release .*no model.safetensors"):
        build_model(cfg, task)


def test_init_from_weights_of_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    """Two tokenizers of one size fit one embedding table, but their ids name other tokens: the weights' tokenizer.json
    (a release's, a checkpoint's copy) must be the corpus's, as `pretrain prepare tokenizer.path=...` copies it."""
    import json

    import models
    from core.config import ConfigError
    from pipelines.engine.config import load_run_config
    from pipelines.engine.model_build import build_model

    release, hf = _gpt2_dir(tmp_path)
    (release / "tokenizer.json").write_text('{"model": "the release tokenizer"}')
    same, other = tmp_path / "corpus-same" / "tokenizer", tmp_path / "corpus-other" / "tokenizer"
    for d, text in ((same, '{"model": "the release tokenizer"}'), (other, '{"model": "a tokenizer trained afresh"}')):
        d.mkdir(parents=True)
        (d / "tokenizer.json").write_text(text)
    task = SimpleNamespace(name="causal_lm", family="gpt", seq_len=32, model_overrides=lambda: {"vocab_size": 120})
    cfg = load_run_config(REPO / "configs/train/gpt_tiny_cpu.yaml", [f"model.init_from={release}", TINY])
    build_model(cfg, task, same)
    with pytest.raises(ConfigError, match=f"another tokenizer than the corpus .*tokenizer.path={release}"):
        build_model(cfg, task, other)

    ckpt = tmp_path / "run" / "checkpoints" / "step-00000007"  # a run's checkpoint: its copy of the corpus tokenizer
    (ckpt / "engine").mkdir(parents=True)
    model = models.create("gpt-tiny", vocab_size=120, hidden_size=32, num_heads=2, intermediate_size=128,
                          num_layers=2, max_position_embeddings=64)
    torch.save(model.state_dict(), ckpt / "engine" / "model.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 7, "model_build": {"name": "gpt-tiny"}}))
    (ckpt.parent / "latest").write_text("step-00000007\n")
    (ckpt / "tokenizer").mkdir()
    (ckpt / "tokenizer" / "tokenizer.json").write_text('{"model": "the release tokenizer"}')
    run_cfg = load_run_config(REPO / "configs/train/gpt_tiny_cpu.yaml", [f"model.init_from={tmp_path / 'run'}", TINY])
    build_model(run_cfg, task, same)
    with pytest.raises(ConfigError, match="another tokenizer than the corpus"):
        build_model(run_cfg, task, other)

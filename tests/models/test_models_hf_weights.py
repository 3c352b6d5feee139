"""A transformers checkpoint directory's tensors in every layout transformers loads, read as data only."""

import json
from pathlib import Path

import pytest
import torch

from core.files import OutsideError
from models import hf as H
from models.safe_load import CheckpointError

transformers = pytest.importorskip("transformers")


class NotATensor:
    """Something a weights_only load must refuse (a pickled class; a real payload would run code)."""


def save_sharded_bin(model: torch.nn.Module, out: Path) -> dict[str, str]:
    """The legacy sharded layout: pytorch_model-0000{1,2}-of-00002.bin + pytorch_model.bin.index.json."""
    model.config.save_pretrained(out)
    sd = model.state_dict()
    keys = sorted(sd)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: sd[k].contiguous() for k in part}, out / name)
        weight_map.update(dict.fromkeys(part, name))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_a_sharded_pytorch_model_bin_loads_as_transformers_loads_it(tmp_path):
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16)
    hf = transformers.BertForMaskedLM(config).eval()
    save_sharded_bin(hf, tmp_path)
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)).__name__ == "BertForMaskedLM"
    ours, report = H.from_hf(tmp_path)
    assert report.unexpected == [] and not [k for k in report.missing if not k.startswith(("nsp.", "bert.pooler"))]
    assert torch.equal(ours.bert.embeddings.word_embeddings.weight, hf.bert.embeddings.word_embeddings.weight)
    ids = torch.tensor([[2, 5, 9, 3]])
    with torch.no_grad():
        assert torch.allclose(ours.eval()(ids)["prediction_logits"], hf(ids).logits, atol=1e-5)


def test_a_sharded_bin_index_reads_nothing_outside_and_no_code(tmp_path):
    """The same checks as sharded safetensors: a shard named outside the directory is refused before it is
    opened; a shard that is not plain tensor data is refused by the weights_only loader, naming the file."""
    hf = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, intermediate_size=64))
    weight_map = save_sharded_bin(hf, tmp_path / "ckpt")
    index = tmp_path / "ckpt" / "pytorch_model.bin.index.json"
    torch.save({"x": torch.zeros(1)}, tmp_path / "outside.bin")
    index.write_text(json.dumps({"weight_map": {**weight_map, "x": "../outside.bin"}}))
    with pytest.raises(OutsideError, match="outside"):
        H.load_hf_state_dict(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "pytorch_model-00002-of-00002.bin"
    index.write_text(json.dumps({"weight_map": weight_map}))
    torch.save({"x": NotATensor()}, shard)
    with pytest.raises(CheckpointError) as err:
        H.load_hf_state_dict(tmp_path / "ckpt")
    assert str(shard) in str(err.value)

"""``model.attention_backend`` (pipelines/engine/model_build.py ``preferred_attention``): the attention kernel a run
tries first, for the whole run, torch's order after it and back to torch's order when the run ends.

On the CPU torch's selector does not read the priority order (it has flash and math only), so these tests check
the order SDPA sees when a run's attention is called; that the GPU selector follows it is torch's contract
(``sdpa_kernel(..., set_priority=True)``), measured by ``benchmarks/attention_backends.py`` and gpu_check's rows.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

from core.config import ConfigError
from pipelines.engine.config import ModelConfig, load_run_config
from pipelines.engine.model_build import ATTENTION_KERNELS, preferred_attention

REPO = Path(__file__).resolve().parents[2]


def test_the_preferred_kernel_comes_first_with_torchs_order_after_it():
    before = _cur_sdpa_kernel_backends(with_priority=True)
    with preferred_attention("auto"):
        assert _cur_sdpa_kernel_backends(with_priority=True) == before
    for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("math", SDPBackend.MATH)):
        with preferred_attention(name):
            during = _cur_sdpa_kernel_backends(with_priority=True)
            # first, then the others as torch ordered them; none turned off (a call it cannot serve falls back)
            assert during == [backend] + [b for b in before if b != backend]
        assert _cur_sdpa_kernel_backends(with_priority=True) == before


def test_the_config_offers_every_kernel_the_run_can_prefer():
    assert typing.get_args(typing.get_type_hints(ModelConfig)["attention_backend"]) == ("auto", *ATTENTION_KERNELS)


def test_an_unknown_kernel_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"model.attention_backend.*cudn.*flash"):  # the value, then the choices
        load_run_config(str(REPO / "configs/train/gpt_tiny_cpu.yaml"), ["model.attention_backend=cudn"])


@pytest.mark.parametrize("name, first", [("auto", None), ("math", SDPBackend.MATH)])
def test_a_run_attends_with_its_preferred_kernel_first(gpt_corpus, tmp_path, monkeypatch, name, first):
    from pipelines.engine.distributed import in_process_run
    from pipelines.engine.trainer import train

    seen, sdpa = [], F.scaled_dot_product_attention

    def recorded(*args, **kwargs):  # the order SDPA sees at every attention call of the run (models/layers.py)
        seen.append(_cur_sdpa_kernel_backends(with_priority=True)[0])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    torch_first = _cur_sdpa_kernel_backends(with_priority=True)[0]
    cfg = load_run_config(str(REPO / "configs/train/gpt_tiny_cpu.yaml"), [
        f"data.corpus={gpt_corpus}", f"train.run_dir={tmp_path / 'run'}", "train.max_steps=2", "train.eval_every=2",
        "train.eval_batches=1", "train.checkpoint_every=0", "data.micro_batch_size=4", "data.num_workers=0",
        "distributed.engine=ddp", "model.compile=false", f"model.attention_backend={name}"])
    with in_process_run():
        assert train(cfg)["steps"] == 2
    assert seen and set(seen) == {first or torch_first}  # training and evaluation alike
    assert _cur_sdpa_kernel_backends(with_priority=True)[0] == torch_first  # torch's order again after the run

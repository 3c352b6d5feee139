"""``model.compile_regions``: a model compiled block by block (``model_build.compile_each_block_``) computes what the
eager model computes, with every operator of its step in a compiled graph and one graph per block, so that
DeepSpeed ZeRO-1/2's gradient hooks fire as each block's backward ends and its bucket reductions start during the
backward (on 2 ranks, through the engine a run builds), where the model compiled as one graph starts none."""

from __future__ import annotations

import collections
import copy
from pathlib import Path

import pytest
import torch
from job_helpers import two_rank_results

import models
from pipelines.engine.model_build import compile_each_block_

JOB = Path(__file__).with_name("compile_regions_job.py")
TINY = dict(num_layers=3, hidden_size=32, num_heads=2, intermediate_size=64, hidden_dropout=0.0, attention_dropout=0.0)


def backward_nodes(loss: torch.Tensor) -> collections.Counter:
    """How many nodes of each kind ``loss``'s autograd graph has (a compiled graph's backward is one node)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return collections.Counter(n.name().rpartition("::")[2] for n in seen)


def _batch(name: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if name == "vit-tiny":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g), "labels": torch.tensor([0, 2])}
    ids = torch.randint(5, 64, (2, 16), generator=g)
    if name == "gpt-tiny":
        return {"input_ids": ids, "labels": ids}
    labels = torch.full_like(ids, -100)
    labels[:, [3, 9]] = ids[:, [3, 9]]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "next_sentence_label": torch.tensor([0, 1]), "masked_positions": torch.tensor([3, 9, 19, 25])}


@pytest.mark.parametrize("name, checkpointing", [("gpt-tiny", True), pytest.param("bert-tiny", False, marks=pytest.mark.slow),
                                                 pytest.param("vit-tiny", False, marks=pytest.mark.slow)])
def test_a_model_compiled_block_by_block_is_the_eager_model_in_one_graph_per_block(name, checkpointing):
    """GPT with activation checkpointing (the 7B plan's setting; in the fast suite, so that the lowest torch runs it
    too); the 2-rank test below compiles GPT without it."""
    torch.manual_seed(0)
    extra = dict(image_size=8, patch_size=4, num_labels=3) if name == "vit-tiny" else dict(vocab_size=64)
    eager = models.create(name, **TINY, **extra)
    eager.set_activation_checkpointing(checkpointing)
    split = copy.deepcopy(eager)
    assert compile_each_block_(split, {}) == 1
    split.compile()
    batch = _batch(name)
    losses = {}
    for key, model in (("eager", eager), ("split", split)):
        loss = model(**batch)["loss"]
        if key == "split":
            nodes = backward_nodes(loss)
        loss.backward()
        losses[key] = float(loss.detach())
    params = len(list(eager.parameters()))
    compiled = nodes.pop("CompiledFunctionBackward")
    assert nodes == {"AccumulateGrad": params}, f"operators left out of every compiled graph: {nodes}"
    # one graph per block, one before and one after them, and one more after a nested module whose forward loops
    # over the blocks (BERT's encoder, ViT's forward_features): the rest of the caller's forward resumes on its own
    assert compiled == TINY["num_layers"] + {"gpt-tiny": 2, "bert-tiny": 3, "vit-tiny": 3}[name], nodes
    assert losses["split"] == pytest.approx(losses["eager"], rel=1e-6)
    for (n, a), b in zip(eager.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert [k for k, _ in eager.state_dict().items()] == list(split.state_dict())  # checkpoints keep their names


@pytest.mark.slow
def test_zero2_reduces_buckets_during_the_backward_only_when_compiled_block_by_block(tmp_path):
    for r in two_rank_results(JOB, tmp_path / "regions.json"):
        one_graph, blocks, auto = r["model"], r["blocks"], r["auto"]
        assert one_graph["compiled_nodes"] == 1 and one_graph["started_during_backward"] == 0, one_graph
        for split in (blocks, auto):  # auto: the engine's JSON overlaps, so the engine compiles block by block
            assert split["compiled_nodes"] == 4 + 2, split  # the job's 4 blocks, the graphs before and after them
            # 9 bucket reductions in a backward, 3 of them started while it still computes (the later blocks' buckets)
            assert split["collectives"] == one_graph["collectives"] == 9 and split["started_during_backward"] == 3, split
            assert split["losses"] == one_graph["losses"]  # bitwise: the same kernels, cut into more graphs

"""The transformer core against written-out references: attention, masks, LN placement, positions, init."""

import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY_TEXT, TINY_VIT, text_batch

import models
from models.init import t_fixup_scale
from models.layers import Block, SelfAttention, TransformerConfig, attention_mask_for_sdpa, sinusoidal_table


def reference_attention(attn: SelfAttention, x, keep=None, causal=False):
    """softmax(Q K^T / sqrt(d_h) + mask) V with separate Q/K/V slices of the fused weight."""
    B, T, C = x.shape
    H = attn.num_heads
    wq, wk, wv = attn.qkv.weight.chunk(3)
    bq, bk, bv = attn.qkv.bias.chunk(3)

    def heads(t):
        return t.view(B, T, H, C // H).transpose(1, 2)

    q, k, v = heads(x @ wq.T + bq), heads(x @ wk.T + bk), heads(x @ wv.T + bv)
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // H)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    if keep is not None:
        allowed &= keep[:, None, None, :].bool()
    if causal:  # causal + padding: a position may always see itself (no all-masked rows)
        allowed &= torch.ones(T, T, dtype=torch.bool).tril()
        allowed |= torch.eye(T, dtype=torch.bool)
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    return attn.proj(y)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_attention_matches_reference(causal, padded):
    attn = SelfAttention(16, 4, dropout=0.0).eval()
    x = torch.randn(2, 6, 16)
    _, keep, _ = text_batch(seq=6, pad_from=4 if padded else None)
    keep = keep if padded else None
    mask, is_causal = attention_mask_for_sdpa(keep, 6, causal)
    got = attn(x, mask, is_causal)
    want = reference_attention(attn, x, keep, causal)
    assert torch.allclose(got, want, atol=1e-6)


def test_padding_mask_hides_padded_keys():
    model = models.create("bert-tiny", **TINY_TEXT).eval()
    ids, mask, types = text_batch(pad_from=5)
    a = model(ids, mask, types)["prediction_logits"][1, :5]
    ids[1, 5:] = 7  # change only padded tokens
    b = model(ids, mask, types)["prediction_logits"][1, :5]
    assert torch.allclose(a, b, atol=1e-6)
    c = model(ids, None, types)["prediction_logits"][1, :5]  # without the mask they leak in
    assert not torch.allclose(a, c, atol=1e-4)


def test_left_padded_causal_batch_is_finite_and_padding_invisible():
    gpt = models.create("gpt-tiny", **TINY_TEXT).eval()
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    a = gpt(ids, mask)["logits"]
    assert torch.isfinite(a).all()
    ids[1, :2] = 9  # change only the padding
    assert torch.allclose(gpt(ids, mask)["logits"][1, 2:], a[1, 2:], atol=1e-6)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_block_layernorm_placement(placement):
    cfg = TransformerConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, norm_placement=placement,
                            hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    block = Block(cfg).eval()
    x = torch.randn(2, 5, 16) * 3 + 1
    y = block(x)
    if placement == "post":  # x = LN(x + F(x)): every output row is normalized
        want = block.norm1(x + block.attn(x))
        want = block.norm2(want + block.mlp(want))
        assert torch.allclose(y.mean(-1), torch.zeros(2, 5), atol=1e-5)
    else:  # x = x + F(LN(x)): the residual stream keeps its scale
        want = x + block.attn(block.norm1(x))
        want = want + block.mlp(block.norm2(want))
        assert y.mean(-1).abs().mean() > 0.1
    assert torch.allclose(y, want, atol=1e-6)


def test_sinusoidal_table_formula():
    table = sinusoidal_table(50, 8)
    pos, i = 17, 3
    assert math.isclose(table[pos, 2 * i].item(), math.sin(pos / 10000 ** (2 * i / 8)), abs_tol=1e-6)
    assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(pos / 10000 ** (2 * i / 8)), abs_tol=1e-6)
    model = models.create("gpt-tiny", **TINY_TEXT, position_embedding="sinusoidal")
    assert "wpe.weight" not in model.state_dict() and not any("wpe" in n for n, _ in model.named_parameters())


def test_tied_embeddings_share_storage():
    bert = models.create("bert-tiny", **TINY_TEXT)
    assert bert.mlm.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    gpt = models.create("gpt-tiny", **TINY_TEXT)
    assert gpt.lm_head.weight is gpt.wte.weight


def test_standard_init_statistics():
    gpt = models.create("gpt2-small", num_layers=4, vocab_size=1000)
    assert abs(gpt.blocks[0].mlp.fc1.weight.std().item() - 0.02) < 1e-3
    assert abs(gpt.blocks[0].mlp.fc2.weight.std().item() - 0.02 / math.sqrt(8)) < 1e-3  # GPT-2 residual scaling
    assert abs(gpt.wte.weight.std().item() - 0.02) < 1e-3
    bert = models.create("bert-tiny", **TINY_TEXT)
    assert torch.all(bert.bert.embeddings.word_embeddings.weight[0] == 0)  # padding row


@pytest.mark.parametrize("name", ["bert-tiny", "gpt-tiny", "vit-tiny"])
def test_t_fixup_removes_layernorm_and_scales(name):
    over = dict(TINY_VIT if name.startswith("vit") else TINY_TEXT, num_layers=4, hidden_size=64, intermediate_size=128)
    model = models.create(name, **over, init="t-fixup")
    block_norms = [m for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm) and not n.startswith("mlm")]
    assert block_norms == []  # only BERT's MLM-head LN (outside the residual stack) remains
    s = t_fixup_scale(4)
    assert math.isclose(s, 0.67 * 4**-0.25)
    d = 64
    block = model.blocks[0] if hasattr(model, "blocks") else model.bert.blocks[0]
    q, _, v = block.attn.qkv.weight.chunk(3)
    xavier_std = math.sqrt(2 / (d + d))
    assert abs(q.std().item() - xavier_std) < 0.1 * xavier_std  # Q, K: plain Xavier
    assert abs(v.std().item() - s * xavier_std) < 0.1 * s * xavier_std  # V, O, MLP: Xavier * 0.67 N^-1/4
    assert abs(block.attn.proj.weight.std().item() - s * xavier_std) < 0.1 * s * xavier_std
    fc_std = math.sqrt(2 / (d + 128))
    assert abs(block.mlp.fc2.weight.std().item() - s * fc_std) < 0.1 * s * fc_std
    if name == "gpt-tiny":
        assert abs(model.wte.weight.std().item() - s * d**-0.5) < 0.1 * s * d**-0.5  # embeddings N(0, d^-1/2) * scale


def test_activation_checkpointing_same_gradients():
    model = models.create("gpt-tiny", **TINY_TEXT, hidden_dropout=0.0, attention_dropout=0.0)
    ids = text_batch(pad_from=None)[0]

    def grads():
        model.zero_grad()
        model(ids, labels=ids)["loss"].backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.set_activation_checkpointing(True)
    assert all(b.checkpointing for b in model.blocks)
    ckpt = grads()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, ckpt, strict=True))
    model.set_activation_checkpointing(True, layers=[1])
    assert [b.checkpointing for b in model.blocks] == [False, True]
    model.set_activation_checkpointing(False)
    assert not any(b.checkpointing for b in model.blocks)


def test_vit_position_interpolation_is_identity_at_training_size_and_bicubic_otherwise():
    vit = models.create("vit-tiny", **TINY_VIT)
    assert vit.position_embeddings(2, 2) is vit.pos_embed
    pos = vit.position_embeddings(4, 3)
    assert pos.shape == (1, 1 + 12, 32)
    grid = vit.pos_embed[:, 1:].reshape(1, 2, 2, 32).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(4, 3), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).reshape(1, 12, 32)
    assert torch.equal(pos[:, 1:], want) and torch.equal(pos[:, :1], vit.pos_embed[:, :1])


def test_vit_in_bf16_takes_the_loaders_fp32_images():
    """DeepSpeed's bf16 mode casts the weights, not the batch (no autocast): fp32 pixels must still work."""
    vit = models.create("vit-tiny", **TINY_VIT)
    pixels, labels = torch.rand(2, 3, 8, 8), torch.tensor([0, 1])
    out = vit.to(torch.bfloat16)(pixels, labels=labels)
    assert out["logits"].dtype == torch.bfloat16 and torch.isfinite(out["loss"])


def test_gpt_generate_greedy_is_deterministic_and_respects_top_k():
    gpt = models.create("gpt-tiny", **TINY_TEXT)
    prompt = torch.tensor([[1, 2, 3]])
    a, b = gpt.generate(prompt, 5, temperature=0), gpt.generate(prompt, 5, temperature=0)
    assert a.shape == (1, 8) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    top1 = gpt.generate(prompt, 5, temperature=1.0, top_k=1)
    assert torch.equal(top1, a)  # top-1 sampling is greedy
    assert gpt.training  # generate restores the mode


def _training_inputs(name: str) -> dict:
    """What the recipe's task feeds the model: BERT MLM+NSP labels (the sparse MLM head), images + labels for ViT."""
    torch.manual_seed(1)
    if name.startswith("vit"):
        return {"pixel_values": torch.randn(4, 3, 8, 8), "labels": torch.tensor([0, 2, 1, 2])}
    ids, mask, types = text_batch()
    labels = torch.full_like(ids, -100)
    labels[:, 1:4] = ids[:, 1:4]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels,
            "next_sentence_label": torch.tensor([0, 1]), "masked_positions": (labels.flatten() != -100).nonzero()[:, 0]}


def test_bert_masked_positions_select_the_boolean_masks_rows_without_a_graph_break():
    """The loader's host-side ``masked_positions`` give the sparse MLM head the rows ``labels != -100`` gives,
    bitwise (loss, logits, every gradient), and compiled, the training forward is one graph: the boolean mask
    broke it in three around a device read of the row count (a host sync on a GPU)."""
    with_positions = _training_inputs("bert-tiny")
    without = {k: v for k, v in with_positions.items() if k != "masked_positions"}
    model = models.create("bert-tiny", **TINY_TEXT, hidden_dropout=0.0, attention_dropout=0.0)
    results = []
    for inputs in (with_positions, without):
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        out["loss"].backward()
        results.append((out["loss"], out["masked_prediction_logits"], [p.grad.clone() for p in model.parameters()]))
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(logits_a, logits_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    explained = torch._dynamo.explain(model)(**with_positions)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert torch._dynamo.explain(model)(**without).graph_break_count > 0  # what the positions avoid


DEVICE_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2"}


def _device_reads(model: torch.nn.Module, inputs: dict) -> dict[str, int]:
    """Operators of a training forward + backward that copy a value the host needs back from the device
    (a host sync on a GPU: ``.item()``, a boolean mask's row count), counted on the CPU by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(**inputs)["loss"].backward()
    names = [e.name for e in prof.events()]
    return {n: names.count(n) for n in DEVICE_READS if n in names}


@pytest.mark.parametrize("name", ["bert-tiny", "gpt-tiny", "vit-tiny"])
def test_a_training_forward_and_backward_read_nothing_back_from_the_device(name):
    """On a GPU such a read makes the host wait for the device mid-step; the trainer makes its own reads
    once a step (tests/pipelines/test_host_syncs.py), the models none."""
    inputs = _training_inputs(name)
    if name.startswith("gpt"):
        inputs = {"input_ids": inputs["input_ids"], "labels": inputs["input_ids"]}
    model = models.create(name, **(TINY_VIT if name.startswith("vit") else TINY_TEXT))
    assert _device_reads(model, inputs) == {}
    if name.startswith("bert"):  # the boolean mask the loader's masked_positions replace
        assert _device_reads(model, {k: v for k, v in inputs.items() if k != "masked_positions"}).get("aten::nonzero")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny"])
def test_torch_compile_trains_like_eager(name):
    """The BERT and ViT GPU recipes compile (model.compile): loss and every gradient match eager."""
    overrides = TINY_VIT if name.startswith("vit") else {**TINY_TEXT, "pad_vocab_multiple": 48}
    model = models.create(name, **overrides, hidden_dropout=0.0, attention_dropout=0.0)
    twin = models.create(name, **overrides, hidden_dropout=0.0, attention_dropout=0.0)
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(twin)
    inputs = _training_inputs(name)
    eager_loss, compiled_loss = model(**inputs)["loss"], compiled(**inputs)["loss"]
    eager_loss.backward()
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    grads = dict(twin.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_t_fixup_deep_bert_scales_with_depth_and_stays_finite():
    """Huang et al. 2020 Alg. 1 step 4: v, w and the MLP matrices of an N-block encoder get 0.67 N^-1/4 x Xavier."""
    stds = {}
    for n in (2, 12):
        torch.manual_seed(0)
        over = dict(TINY_TEXT, num_layers=n, hidden_size=64, intermediate_size=256)
        model = models.create("bert-tiny", **over, init="t-fixup")
        blocks = model.bert.blocks
        stds[n] = statistics.fmean(b.attn.proj.weight.std().item() for b in blocks)
        ids = torch.randint(5, TINY_TEXT["vocab_size"], (2, 16))
        out = model(ids, labels=torch.where(torch.rand(2, 16) < 0.3, ids, -100), next_sentence_label=torch.tensor([0, 1]))
        assert torch.isfinite(out["loss"]) and 0 < out["loss"].item() < 3 * math.log(TINY_TEXT["vocab_size"])
        out["loss"].backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert stds[12] / stds[2] == pytest.approx(t_fixup_scale(12) / t_fixup_scale(2), rel=0.05)  # = (2/12)^(1/4)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs (activation memory)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_chunked_lm_loss_equals_the_one_shot_loss_and_holds_no_full_logits():
    overrides = dict(TINY_TEXT, vocab_size=500, max_position_embeddings=32, pad_vocab_multiple=64,
                     hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    plain = models.create("gpt-tiny", **overrides)
    chunked = models.create("gpt-tiny", **overrides, loss_chunk_tokens=12)  # 64 positions: 5 chunks, the last partial
    chunked.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 500, (4, 16))
    labels = ids.clone()
    labels[1, 10:] = -100
    a, saved_plain = _saved_bytes(lambda: plain(ids, labels=labels))
    b, saved_chunked = _saved_bytes(lambda: chunked(ids, labels=labels))
    assert "logits" not in b  # none were made
    torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-6, atol=1e-6)
    a["loss"].backward()
    b["loss"].backward()
    got = dict(chunked.named_parameters())
    for n, p in plain.named_parameters():
        torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)
    full_logits = ids.numel() * 500 * 4
    assert saved_plain - saved_chunked >= full_logits, (saved_plain, saved_chunked)
    chunked.eval()  # evaluation still gets the logits (accuracy)
    assert chunked(ids, labels=labels)["logits"].shape == (4, 16, 500)


def _backward_inputs(model, inputs) -> list[tuple[int, ...]]:
    """Shapes of the gradients a compiled model's backward receives for its outputs (AOTAutograd's tangents)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    tangents: list[tuple[int, ...]] = []

    def backend(gm, example_inputs):
        def backward_compiler(graph, _):
            tangents.extend(tuple(n.meta["val"].shape) for n in graph.graph.nodes
                            if n.op == "placeholder" and n.name.startswith("tangents"))
            return graph.forward
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g.forward, bw_compiler=backward_compiler)

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(**inputs)["loss"].backward()
    torch._dynamo.reset()
    return tangents


def test_gpt_training_step_without_logits_computes_the_same_and_gives_backward_no_logits_gradient():
    """``train_logits=False`` (the GPU GPT recipes): a training forward with labels returns the loss only, the
    same loss and gradients bitwise; compiled, its backward no longer takes a [B, T, V] zero gradient for the
    unused logits (it did: the memory pass this removes). Evaluation still returns the logits."""
    overrides = dict(TINY_TEXT, vocab_size=500, pad_vocab_multiple=64, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    full = models.create("gpt-tiny", **overrides)
    lean = models.create("gpt-tiny", **overrides, train_logits=False)
    lean.load_state_dict(full.state_dict())
    ids = torch.randint(0, 500, (4, 16))
    a, b = full(ids, labels=ids), lean(ids, labels=ids)
    assert set(b) == {"loss"} and torch.equal(a["loss"], b["loss"])
    a["loss"].backward()
    b["loss"].backward()
    got = dict(lean.named_parameters())
    assert all(torch.equal(got[n].grad, p.grad) for n, p in full.named_parameters())
    logits_shape = (4, 16, 500)
    assert logits_shape in _backward_inputs(full, {"input_ids": ids, "labels": ids})
    assert logits_shape not in _backward_inputs(lean, {"input_ids": ids, "labels": ids})
    with torch.no_grad():
        assert lean(ids, labels=ids)["logits"].shape == logits_shape  # evaluation
    assert lean.eval()(ids, labels=ids)["logits"].shape == logits_shape


class _SplitAttention(SelfAttention):
    """Q, K and V as the plain loops take them from the fused projection: ``split`` + ``view`` + ``transpose``."""

    def forward(self, x, attn_mask=None, is_causal=False):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def _compiled_kernels(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Kernels inductor generates for one compiled forward + backward (each at least one pass over memory)."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    torch.compile(block)(x).sum().backward()
    count = metrics.generated_kernel_count
    torch._dynamo.reset()
    return count


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_a_compiled_block_makes_no_more_kernels_than_the_plain_loops_attention(placement):
    """Each kernel is a pass over the activations: our block's backward once took one more per layer than a plain
    loop's (unbind's backward stacked the Q, K, V gradients, then copied the stack into the projection's layout;
    docs/benchmarks.md, model_step), in GPT, BERT and ViT alike."""
    cfg = TransformerConfig(hidden_size=32, num_heads=2, intermediate_size=64, hidden_dropout=0.0,
                            attention_dropout=0.0, norm_placement=placement)
    ours, plain = Block(cfg), Block(cfg)
    plain.attn.__class__ = _SplitAttention
    x = torch.randn(2, 16, 32, requires_grad=True)
    assert _compiled_kernels(ours, x) <= _compiled_kernels(plain, x)

"""Exact interop with transformers: ours -> to_hf, transformers checkpoint -> from_hf, round trips."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TINY_TEXT, TINY_VIT, text_batch

import models
from models import hf as H

transformers = pytest.importorskip("transformers")
TOL = 1e-5


def maxdiff(a, b):
    return (a - b).abs().max().item()


def hf_bert_config(**kw):
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=16)  # fmt: skip
    return transformers.BertConfig(**{**base, **kw})


def randomize_(model):
    """transformers' init leaves LayerNorm at (1, 0) and biases at 0; perturb so the test sees every tensor."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


# ---------------------------------------------------------------- BERT


def test_bert_pretraining_to_hf_same_outputs_and_loss():
    ours = randomize_(models.create("bert-tiny", **TINY_TEXT)).eval()
    hf = H.to_hf(ours)
    assert isinstance(hf, transformers.BertForPreTraining)
    ids, mask, types = text_batch()
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    nsp = torch.tensor([0, 1])
    a = ours(ids, mask, types, labels=labels, next_sentence_label=nsp)
    b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)
    assert maxdiff(a["masked_prediction_logits"], b.prediction_logits[labels != -100]) < TOL
    assert maxdiff(ours(ids, mask, types)["prediction_logits"], b.prediction_logits) < TOL
    assert maxdiff(a["seq_relationship_logits"], b.seq_relationship_logits) < TOL
    assert abs(a["loss"].item() - b.loss.item()) < TOL


def test_bert_from_hf_checkpoint_dir_same_outputs(tmp_path):
    hf = randomize_(transformers.BertForPreTraining(hf_bert_config())).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours, report = H.from_hf(tmp_path)
    assert isinstance(ours, models.BertForPreTraining) and ours.family == "bert"
    assert report.missing == [] and report.unexpected == []
    ids, mask, types = text_batch()
    a, b = ours.eval()(ids, mask, types), hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert maxdiff(a["prediction_logits"], b.prediction_logits) < TOL
    assert maxdiff(a["seq_relationship_logits"], b.seq_relationship_logits) < TOL


def test_bert_round_trip_is_lossless(tmp_path):
    ours = randomize_(models.create("bert-tiny", **TINY_TEXT))
    H.to_hf(ours).save_pretrained(tmp_path, safe_serialization=True)
    back, report = H.from_hf(tmp_path)
    assert report.missing == [] and report.unexpected == []
    sd_a, sd_b = ours.state_dict(), back.state_dict()
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert back.config == ours.config


def test_bert_model_release_initializes_and_reports_missing_heads(tmp_path):
    hf = transformers.BertModel(hf_bert_config(), add_pooling_layer=False)
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="freshly initialized"):
        ours, report = H.from_hf(tmp_path, head="pretraining")
    assert isinstance(ours, models.BertForPreTraining)
    assert set(report.missing) == {
        "bert.pooler.weight", "bert.pooler.bias", "mlm.dense.weight", "mlm.dense.bias", "mlm.norm.weight",
        "mlm.norm.bias", "mlm.decoder.bias", "nsp.weight", "nsp.bias",
    }  # fmt: skip
    # the encoder itself was loaded exactly
    ids, mask, types = text_batch()
    a = ours.eval().bert(ids, mask, types)["last_hidden_state"]
    assert maxdiff(a, hf.eval()(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state) < TOL


def test_bert_model_release_defaults_to_encoder(tmp_path):
    H.to_hf(models.BertEncoder(models.get_config("bert-tiny", **TINY_TEXT))).save_pretrained(tmp_path)
    enc, report = H.from_hf(tmp_path)
    assert isinstance(enc, models.BertEncoder) and enc.pooler is not None
    assert report.missing == [] and report.unexpected == []


def test_unexpected_keys_are_listed_and_bin_is_read_weights_only(tmp_path):
    hf = transformers.BertForPreTraining(hf_bert_config())
    hf.config.save_pretrained(tmp_path)
    sd = {k: v for k, v in hf.state_dict().items() if "decoder" not in k}
    sd["bert.extra.weight"] = torch.zeros(3)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    ours, report = H.from_hf(tmp_path)
    assert report.unexpected == ["bert.extra.weight"]
    assert report.missing == []
    assert torch.equal(ours.bert.embeddings.word_embeddings.weight, hf.bert.embeddings.word_embeddings.weight)


def test_legacy_gamma_beta_layernorm_names(tmp_path):
    hf = randomize_(transformers.BertModel(hf_bert_config())).eval()
    hf.config.save_pretrained(tmp_path)
    sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v.contiguous()
          for k, v in hf.state_dict().items()}  # fmt: skip
    save_file(sd, tmp_path / "model.safetensors")
    enc, report = H.from_hf(tmp_path, head="encoder")
    assert isinstance(enc, models.BertEncoder) and report.missing == [] and report.unexpected == []
    ids, mask, types = text_batch()
    b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    a = enc.eval()(ids, mask, types)
    assert maxdiff(a["last_hidden_state"], b.last_hidden_state) < TOL
    assert maxdiff(a["pooler_output"], b.pooler_output) < TOL


def test_sinusoidal_bert_converts_with_the_table_as_positions():
    ours = randomize_(models.create("bert-tiny", **TINY_TEXT, position_embedding="sinusoidal")).eval()
    hf = H.to_hf(ours)
    ids, mask, types = text_batch()
    b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert maxdiff(ours(ids, mask, types)["prediction_logits"], b.prediction_logits) < TOL


@pytest.mark.parametrize("overrides", [{"norm_placement": "pre"}, {"init": "t-fixup"}])
def test_variants_without_hf_equivalent_refuse(overrides):
    with pytest.raises(ValueError, match="no transformers equivalent"):
        H.to_hf(models.create("bert-tiny", **TINY_TEXT, **overrides))


@pytest.mark.parametrize("num_labels", [3, 1])
def test_sequence_classifier_round_trip(tmp_path, num_labels):
    bert = randomize_(models.create("bert-tiny", **TINY_TEXT))
    id2label = {0: "neg", 1: "neu", 2: "pos"} if num_labels == 3 else None
    clf = models.SequenceClassifier.from_pretrained_encoder(bert, num_labels, id2label=id2label).eval()
    hf = H.to_hf(clf)
    assert isinstance(hf, transformers.BertForSequenceClassification)
    if id2label:
        assert hf.config.id2label == id2label
    ids, mask, types = text_batch()
    labels = torch.tensor([2, 0]) if num_labels == 3 else torch.tensor([0.5, -1.0])
    a = clf(ids, mask, types, labels=labels)
    b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    assert maxdiff(a["logits"], b.logits) < TOL and abs(a["loss"].item() - b.loss.item()) < TOL
    hf.save_pretrained(tmp_path, safe_serialization=True)
    back, report = H.from_hf(tmp_path)
    assert isinstance(back, models.SequenceClassifier) and back.num_labels == num_labels
    assert back.id2label == id2label and report.missing == [] and report.unexpected == []
    assert maxdiff(back.eval()(ids, mask, types)["logits"], a["logits"]) == 0


def test_pretrained_bert_dir_loads_into_new_classifier(tmp_path):
    transformers.BertForPreTraining(hf_bert_config()).save_pretrained(tmp_path)
    clf, report = H.from_hf(tmp_path, head="classification", num_labels=4)
    assert isinstance(clf, models.SequenceClassifier) and clf.num_labels == 4
    assert set(report.missing) == {"classifier.weight", "classifier.bias"}
    assert any(k.startswith("cls.") for k in report.unexpected)  # the MLM/NSP heads are not used


@pytest.mark.parametrize("source", [
    dict(num_labels=6, problem_type="multi_label_classification"),
    dict(num_labels=1, problem_type="regression"),
    dict(num_labels=2, problem_type="single_label_classification", id2label={0: "neg", 1: "pos"},
         label2id={"neg": 0, "pos": 1}),
])
@pytest.mark.parametrize("task", ["four classes", "regression"])
def test_a_new_task_head_takes_nothing_from_an_outside_classifiers_head(tmp_path, source, task):
    """An outside classifier's problem_type and labels belong to its old task: a new head that kept them exported
    a 4-class single-label model as multi-label (wrong loss and pipeline scores) or could not be built at all."""
    transformers.BertForSequenceClassification(hf_bert_config(**source)).save_pretrained(tmp_path)
    names = {0: "a", 1: "b", 2: "c", 3: "d"} if task == "four classes" else None
    clf, _ = H.from_hf(tmp_path, head="classification", num_labels=4 if names else 1, id2label=names)
    assert clf.problem_type is None and clf.id2label == names and clf.num_labels == (4 if names else 1)
    hf = H.to_hf(clf)
    assert hf.config.problem_type is None and hf.config.num_labels == clf.num_labels
    ids, mask, types = text_batch()
    labels = torch.tensor([3, 0]) if names else torch.tensor([0.5, -1.0])
    assert hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss.isfinite()
    back, _ = H.from_hf(tmp_path)  # loaded as itself, the classifier keeps its own head
    assert back.problem_type == source["problem_type"] and back.num_labels == source["num_labels"]


@pytest.mark.parametrize("labels", [{0: "ham", 1: "spam"}, {0: "pos", 1: "neg"}, {0: "neg", 1: "pos"}])
@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_a_new_task_head_of_the_same_size_is_fresh_unless_its_labels_are_the_checkpoints(tmp_path, family, labels):
    """A BertForSequenceClassification / GPT2ForSequenceClassification of neg/pos fine-tuned on two other labels
    (or the same two in another order) started from the old head's rows, silently: of the same shape, it loaded.
    Only a head of the very same labels (a fine-tuned release trained further) is kept."""
    old = {"id2label": {0: "neg", 1: "pos"}, "label2id": {"neg": 0, "pos": 1}}
    if family == "bert":
        transformers.BertForSequenceClassification(hf_bert_config(num_labels=2, **old)).save_pretrained(tmp_path)
        key = "classifier.weight"
    else:
        transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
            vocab_size=99, n_positions=32, n_embd=32, n_layer=1, n_head=2, num_labels=2, **old)).save_pretrained(tmp_path)
        key = "score.weight"
    clf, report = H.from_hf(tmp_path, head="classification", num_labels=2, id2label=labels)
    same = labels == old["id2label"]
    assert torch.equal(clf.state_dict()[key], load_file(tmp_path / "model.safetensors")[key]) == same
    assert (key in report.missing) != same


@pytest.mark.parametrize("pad", [None, 0])
def test_a_null_pad_token_id_freezes_no_embedding_row(tmp_path, pad):
    """transformers reads ``"pad_token_id": null`` as no padding_idx; reading it as 0 froze token 0's embedding
    (a RoBERTa-style vocabulary's <s>, the first token of every example) through fine-tuning."""
    transformers.BertForMaskedLM(hf_bert_config(pad_token_id=pad)).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("pad_token_id") == pad
    clf, _ = H.from_hf(tmp_path, head="classification", num_labels=2)
    embeddings = clf.backbone.embeddings.word_embeddings
    assert embeddings.padding_idx == pad == transformers.BertModel.from_pretrained(tmp_path).embeddings.word_embeddings.padding_idx
    clf(torch.tensor([[0, 5, 6]]))["logits"].sum().backward()
    assert (embeddings.weight.grad[0].abs().sum() > 0) == (pad is None)
    assert H.to_hf(clf).config.pad_token_id == pad  # and exported as it came


def test_question_answering_round_trip(tmp_path):
    qa = models.QuestionAnswering.from_pretrained_encoder(randomize_(models.create("bert-tiny", **TINY_TEXT))).eval()
    assert qa.backbone.pooler is None
    hf = H.to_hf(qa)
    assert isinstance(hf, transformers.BertForQuestionAnswering)
    ids, mask, types = text_batch()
    s, e = torch.tensor([1, 2]), torch.tensor([3, 20])  # 20 is out of range: clamped and ignored
    a = qa(ids, mask, types, start_positions=s, end_positions=e)
    b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, start_positions=s, end_positions=e)
    assert maxdiff(a["start_logits"], b.start_logits) < TOL and maxdiff(a["end_logits"], b.end_logits) < TOL
    assert abs(a["loss"].item() - b.loss.item()) < TOL
    hf.save_pretrained(tmp_path)
    back, report = H.from_hf(tmp_path)
    assert isinstance(back, models.QuestionAnswering) and report.missing == [] and report.unexpected == []
    assert maxdiff(back.eval()(ids, mask, types)["start_logits"], a["start_logits"]) == 0


# ---------------------------------------------------------------- GPT-2


def test_gpt_to_hf_same_logits_causal_with_padding_and_shifted_loss():
    ours = randomize_(models.create("gpt-tiny", **TINY_TEXT)).eval()
    hf = H.to_hf(ours)
    assert isinstance(hf, transformers.GPT2LMHeadModel)
    ids, mask, _ = text_batch()
    a, b = ours(ids, mask)["logits"], hf(input_ids=ids, attention_mask=mask).logits
    assert maxdiff(a[0], b[0]) < TOL and maxdiff(a[1, :5], b[1, :5]) < TOL  # padded positions are don't-care
    ids = ids[:1]
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # the collator's shift
    assert abs(ours(ids, labels=labels)["loss"].item() - hf(input_ids=ids, labels=ids).loss.item()) < TOL
    # causal: changing a later token leaves earlier logits unchanged
    ids2 = ids.clone()
    ids2[0, -1] = (ids2[0, -1] + 1) % 64
    assert torch.allclose(ours(ids)["logits"][:, :-1], ours(ids2)["logits"][:, :-1], atol=1e-6)


def test_gpt_from_hf_dir_and_round_trip(tmp_path):
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    hf = randomize_(transformers.GPT2LMHeadModel(cfg)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours, report = H.from_hf(tmp_path)
    assert isinstance(ours, models.GPT) and report.missing == [] and report.unexpected == []
    ids, _, _ = text_batch(pad_from=None)
    assert maxdiff(ours.eval()(ids)["logits"], hf(input_ids=ids).logits) < TOL
    H.to_hf(ours).save_pretrained(tmp_path / "again")
    a, b = load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- ViT


def vit_pixels(size):
    return torch.randn(2, 3, *size)


def test_vit_to_hf_same_logits_also_at_another_image_size():
    ours = randomize_(models.create("vit-tiny", **TINY_VIT)).eval()
    hf = H.to_hf(ours)
    assert isinstance(hf, transformers.ViTForImageClassification)
    x = vit_pixels((8, 8))
    assert maxdiff(ours(x)["logits"], hf(pixel_values=x).logits) < TOL
    x = vit_pixels((16, 12))  # a 4x3 patch grid: bicubic-resized positions
    assert maxdiff(ours(x)["logits"], hf(pixel_values=x, interpolate_pos_encoding=True).logits) < TOL
    labels = torch.tensor([0, 2])
    assert (
        abs(
            ours(x, labels)["loss"].item()
            - hf(pixel_values=x, labels=labels, interpolate_pos_encoding=True).loss.item()
        )
        < TOL
    )


def test_vit_from_hf_dir_instance_and_round_trip(tmp_path):
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=8, patch_size=4, num_labels=3, id2label={0: "cat", 1: "dog", 2: "fox"},
                                 label2id={"cat": 0, "dog": 1, "fox": 2})  # fmt: skip
    hf = randomize_(transformers.ViTForImageClassification(cfg)).eval()
    hf.save_pretrained(tmp_path)
    x = vit_pixels((8, 8))
    for src in (tmp_path, hf):  # on-disk names and transformers' in-memory names
        ours, report = H.from_hf(src)
        assert isinstance(ours, models.ViT) and report.missing == [] and report.unexpected == []
        assert ours.config.id2label == {0: "cat", 1: "dog", 2: "fox"}
        assert maxdiff(ours.eval()(x)["logits"], hf(pixel_values=x).logits) < TOL
    H.to_hf(ours).save_pretrained(tmp_path / "again")
    a, b = load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["id2label"]["1"] == "dog"


def test_vit_new_label_count_reinitializes_only_the_head(tmp_path):
    H.to_hf(models.create("vit-tiny", **TINY_VIT)).save_pretrained(tmp_path)
    ours, report = H.from_hf(tmp_path, num_labels=5)
    assert ours.config.num_labels == 5
    assert report.missing == ["head.bias", "head.weight"]
    assert report.unexpected == ["classifier.bias", "classifier.weight"]


# ---------------------------------------------------------------- vocabulary padding (models.vocab)


def _lm_outputs(model, ids):
    """(scores over the vocabulary, loss) of a GPT or a BERT pretraining model on ``ids``."""
    if isinstance(model, models.GPT):
        out = model(ids, labels=ids)
        return out["logits"], out["loss"]
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]
    nsp = torch.tensor([0, 1])
    return model(ids)["prediction_logits"], model(ids, labels=labels, next_sentence_label=nsp)["loss"]


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
def test_padded_vocabulary_trains_and_exports_as_the_tokenizers_vocabulary(name, tmp_path):
    vocab = 60  # padded to 64 rows: the release must still have 60
    plain = randomize_(models.create(name, **{**TINY_TEXT, "vocab_size": vocab})).eval()
    H.to_hf(plain).save_pretrained(tmp_path / "plain")
    padded, report = H.from_hf(tmp_path / "plain", pad_vocab_multiple=64)  # import pads again
    emb = padded.wte if isinstance(padded, models.GPT) else padded.bert.embeddings.word_embeddings
    assert report.missing == [] and padded.config.vocab_size == vocab and emb.weight.shape[0] == 64
    assert torch.count_nonzero(emb.weight[vocab:]) == 0

    ids, _, _ = text_batch(vocab=vocab, pad_from=None)
    (a, loss_a), (b, loss_b) = _lm_outputs(plain, ids), _lm_outputs(padded.eval(), ids)
    assert a.shape == b.shape and a.shape[-1] == vocab
    assert maxdiff(a, b) < TOL and abs(loss_a.item() - loss_b.item()) < TOL

    padded.train()
    _lm_outputs(padded, ids)[1].backward()
    assert torch.count_nonzero(emb.weight.grad[vocab:]) == 0  # the padding rows never learn: they stay 0

    with torch.no_grad():  # padding rows that would outscore every token still never win
        emb.weight[vocab:] = 100.0
    padded.eval()
    assert maxdiff(_lm_outputs(padded, ids)[0], a) < TOL
    if isinstance(padded, models.GPT):
        assert torch.equal(padded.generate(ids, 4, temperature=0), plain.generate(ids, 4, temperature=0))
        assert int(padded.generate(ids, 4, temperature=1.0).max()) < vocab

    with torch.no_grad():
        emb.weight[vocab:] = 0.0
    H.to_hf(padded).save_pretrained(tmp_path / "again")  # export slices: the release is the plain model's
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())
    assert cfg["vocab_size"] == vocab
    a_sd, b_sd = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a_sd.keys() == b_sd.keys() and all(torch.equal(a_sd[k], b_sd[k]) for k in a_sd)


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
def test_a_padded_model_starts_from_the_unpadded_ones_weights_and_random_stream(name):
    from models.vocab import unpad_vocab

    built = []
    for pad in (1, 64):
        torch.manual_seed(0)
        model = models.create(name, **{**TINY_TEXT, "vocab_size": 60}, pad_vocab_multiple=pad)
        built.append(({k: unpad_vocab(k, v, 60) for k, v in model.state_dict().items()}, torch.rand(3)))
    (plain, after_plain), (padded, after_padded) = built
    assert plain.keys() == padded.keys() and all(torch.equal(plain[k], padded[k]) for k in plain)
    assert torch.equal(after_plain, after_padded)  # dropout / data draws that follow are the same too


def test_pad_vocab_multiple_is_validated():
    with pytest.raises(ValueError, match="pad_vocab_multiple"):
        models.create("gpt-tiny", **TINY_TEXT, pad_vocab_multiple=0)
    assert models.get_config("gpt2-small", pad_vocab_multiple=64).padded_vocab_size == 50304
    assert models.get_config("bert-base", pad_vocab_multiple=64).padded_vocab_size == 30528

"""Task heads: BERT's MLM head, and fine-tuning heads that wrap any encoder backbone.

A *backbone* is a module with ``.config`` (with ``hidden_size``), ``.family`` and
``forward(input_ids, attention_mask=None, token_type_ids=None) -> {"last_hidden_state", "pooler_output"?}``
— e.g. ``models.bert.BertEncoder``. Build a fine-tuning model from a pretraining model with
``SequenceClassifier.from_pretrained_encoder(pretrained, num_labels)`` /
``QuestionAnswering.from_pretrained_encoder(pretrained)``: the backbone is *shared* with
(not copied from) ``pretrained``, whose own heads are then simply unused.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .layers import TransformerConfig

__all__ = ["MLMHead", "SequenceClassifier", "LastTokenClassifier", "QuestionAnswering", "backbone_of",
           "last_non_pad_index", "sequence_classification_loss"]

ProblemType = Literal["regression", "single_label_classification", "multi_label_classification"]


class MLMHead(nn.Module):
    """BERT's masked-LM head: logits = LN(GELU(W h + b)) E^T + b_vocab, E tied to the token embedding."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, vocab_size)  # weight is tied by the model
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(h), approximate=self.approximate)))


def backbone_of(model: nn.Module) -> nn.Module:
    """The encoder backbone of a pretraining model (``model.get_encoder()``), or ``model`` itself."""
    return model.get_encoder() if hasattr(model, "get_encoder") else model


class _Head(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config  # hidden_size / max_position_embeddings for the trainer and FLOPs
        self.family = backbone.family

    def set_activation_checkpointing(self, enabled: bool = True, layers=None) -> None:
        self.backbone.set_activation_checkpointing(enabled, layers)


class SequenceClassifier(_Head):
    """Single-text or pair classification on the pooled [CLS] state (BERT §4.1, ``BertForSequenceClassification``).

    logits = W Dropout(pool(h)) + b, pool = the backbone's ``pooler_output`` (BERT's tanh pooler)
    or else the first token's state. Loss (HF ``problem_type`` rules): ``num_labels == 1`` →
    regression, MSE; integer labels → cross-entropy; float labels ``[B, num_labels]`` → multi-label BCE.
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_labels: int,
        *,
        dropout: float | None = None,
        id2label: dict[int, str] | None = None,
        problem_type: ProblemType | None = None,
    ):
        super().__init__(backbone)
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}.")
        if id2label is not None and len(id2label) != num_labels:
            raise ValueError(f"id2label has {len(id2label)} names but num_labels is {num_labels}.")
        self.num_labels = num_labels
        self.id2label = {int(k): str(v) for k, v in id2label.items()} if id2label else None
        self.problem_type = problem_type
        self.dropout_p = self.config.hidden_dropout if dropout is None else dropout
        self.dropout = nn.Dropout(self.dropout_p)
        self.classifier = nn.Linear(self.config.hidden_size, num_labels)
        nn.init.normal_(self.classifier.weight, std=getattr(self.config, "initializer_range", 0.02))
        nn.init.zeros_(self.classifier.bias)

    @classmethod
    def from_pretrained_encoder(cls, model: nn.Module, num_labels: int, **kwargs) -> SequenceClassifier:
        """A classifier on the (shared) encoder of a pretraining model, e.g. ``BertForPreTraining``."""
        return cls(backbone_of(model), num_labels, **kwargs)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> dict[str, torch.Tensor]:
        out = self.backbone(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        pooled = out.get("pooler_output")
        if pooled is None:
            pooled = out["last_hidden_state"][:, 0]
        logits = self.classifier(self.dropout(pooled))
        result = {"logits": logits}
        if labels is not None:
            result["loss"] = self._loss(logits, labels)
        return result

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return sequence_classification_loss(logits, labels, self.num_labels, self.problem_type)


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, num_labels: int,
                                 problem_type: ProblemType | None) -> torch.Tensor:
    """transformers' ``*ForSequenceClassification`` loss: ``problem_type``, else inferred as they do
    (one label -> MSE; integer labels -> cross-entropy; float labels ``[B, num_labels]`` -> multi-label BCE)."""
    kind = problem_type
    if kind is None:
        if num_labels == 1:
            kind = "regression"
        elif labels.dtype in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
            kind = "single_label_classification"
        else:
            kind = "multi_label_classification"
    if kind == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1))
    if kind == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


def last_non_pad_index(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Per row, the position of the rightmost token that is not ``pad_token_id`` (0 for a row of pads only),
    exactly as ``GPT2ForSequenceClassification`` picks the token it classifies; -1 (the last) without a pad id."""
    if pad_token_id is None:
        if input_ids.shape[0] != 1:
            raise ValueError("Cannot classify batches of more than one sequence without a pad_token_id (rows "
                             "of different lengths cannot be told apart); set the model's pad_token_id.")
        return torch.full((1,), -1, dtype=torch.long, device=input_ids.device)
    non_pad = (input_ids != pad_token_id).to(torch.int32)
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=torch.int32)
    return (positions * non_pad).argmax(-1)


class LastTokenClassifier(_Head):
    """Sequence classification on a causal decoder (``GPT2ForSequenceClassification``).

    logits = W h_last (no bias, no dropout), h_last = the final state of each row's last non-pad token
    (``last_non_pad_index``: a causal model has read the whole text only there). Right padding; the
    loss is ``sequence_classification_loss``. The backbone's LM head is dropped (unused: DDP/ZeRO
    complain about parameters outside the graph; a tied one is the token embedding, which stays).
    """

    def __init__(self, backbone: nn.Module, num_labels: int, *, pad_token_id: int | None,
                 id2label: dict[int, str] | None = None, problem_type: ProblemType | None = None):
        super().__init__(backbone)
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}.")
        if id2label is not None and len(id2label) != num_labels:
            raise ValueError(f"id2label has {len(id2label)} names but num_labels is {num_labels}.")
        if getattr(backbone, "lm_head", None) is not None:
            backbone.lm_head = None
        self.num_labels, self.pad_token_id, self.problem_type = num_labels, pad_token_id, problem_type
        self.id2label = {int(k): str(v) for k, v in id2label.items()} if id2label else None
        self.score = nn.Linear(self.config.hidden_size, num_labels, bias=False)
        nn.init.normal_(self.score.weight, std=getattr(self.config, "initializer_range", 0.02))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> dict[str, torch.Tensor]:
        # token_type_ids: accepted for the shared fine-tuning batches, not used (the release's tokenizer returns none)
        h = self.backbone.hidden_states(input_ids, attention_mask)
        last = last_non_pad_index(input_ids, self.pad_token_id)
        logits = self.score(h[torch.arange(h.shape[0], device=h.device), last])
        result = {"logits": logits}
        if labels is not None:
            result["loss"] = sequence_classification_loss(logits, labels, self.num_labels, self.problem_type)
        return result


class QuestionAnswering(_Head):
    """Extractive QA (BERT §4.2, ``BertForQuestionAnswering``): [start, end] logits = W h_t + b per token.

    Loss = (CE(start_logits, s) + CE(end_logits, e)) / 2; positions outside the sequence are clamped
    to T and ignored, as in HF. The backbone's pooler is unused, so it is dropped (``pooler = None``)
    to keep every parameter in the graph (DDP/ZeRO complain about unused ones).
    """

    def __init__(self, backbone: nn.Module):
        super().__init__(backbone)
        if getattr(backbone, "pooler", None) is not None:
            backbone.pooler = None
        self.qa_outputs = nn.Linear(self.config.hidden_size, 2)
        nn.init.normal_(self.qa_outputs.weight, std=getattr(self.config, "initializer_range", 0.02))
        nn.init.zeros_(self.qa_outputs.bias)

    @classmethod
    def from_pretrained_encoder(cls, model: nn.Module) -> QuestionAnswering:
        """A span head on the (shared) encoder of a pretraining model; its pooler is removed."""
        return cls(backbone_of(model))

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, start_positions=None, end_positions=None
    ) -> dict[str, torch.Tensor]:
        h = self.backbone(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)["last_hidden_state"]
        start_logits, end_logits = self.qa_outputs(h).unbind(-1)
        result = {"start_logits": start_logits, "end_logits": end_logits}
        if start_positions is not None and end_positions is not None:
            T = start_logits.shape[1]
            start = start_positions.view(-1).clamp(0, T)
            end = end_positions.view(-1).clamp(0, T)
            result["loss"] = (
                F.cross_entropy(start_logits, start, ignore_index=T) + F.cross_entropy(end_logits, end, ignore_index=T)
            ) / 2
        return result

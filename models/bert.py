"""BERT (Devlin et al. 2019): bidirectional encoder pretrained with masked LM + next-sentence prediction.

Input representation (§3.2): h_0 = LN(E_token[x] + E_pos[t] + E_segment[s]); an N-block post-LN
encoder (pre-LN and T-Fixup are variants for study); pooler p = tanh(W h_N[CLS] + b); MLM head on
every position (see ``heads.MLMHead``) with the decoder tied to E_token; NSP head = Linear(p, 2).
Loss (§3.1, Appendix A.2) = mean CE over masked positions (labels -100 elsewhere) + CE(NSP).
State-dict layout maps 1:1 onto ``transformers.BertForPreTraining`` (see ``models.hf``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.families.bert import BertConfig

from . import init as inits
from .heads import MLMHead
from .layers import Block, SinusoidalPositionEmbedding, attention_mask_for_sdpa, make_norm, run_blocks
from .layers import set_activation_checkpointing as _set_ckpt
from .registry import register_module
from .vocab import pad_vocab_rows_

__all__ = ["BertConfig", "BertEncoder", "BertForPreTraining", "masked_mean_cross_entropy"]


class BertEmbeddings(nn.Module):
    """h_0 = Dropout(LN(E_token[x] + E_pos[t] + E_segment[s]))."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        if cfg.position_embedding == "learned":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        else:
            self.position_embeddings = SinusoidalPositionEmbedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.norm(x))


class BertEncoder(nn.Module):
    """Embeddings + N blocks (+ final LN for pre-LN) + tanh pooler: the backbone heads attach to (``BertModel``)."""

    family = "bert"

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True, init: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        # Xiong et al. 2020: a pre-LN stack needs a final LN; post-LN output is already normalized.
        self.final_norm = make_norm(config) if config.norm_placement == "pre" else nn.Identity()
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooling_layer else None
        if init:
            self.init_weights()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> dict[str, torch.Tensor]:
        mask, _ = attention_mask_for_sdpa(attention_mask, input_ids.shape[1], causal=False)
        h = self.embeddings(input_ids, token_type_ids)
        h = run_blocks(self.blocks, h, mask)
        h = self.final_norm(h)
        out = {"last_hidden_state": h}
        if self.pooler is not None:
            out["pooler_output"] = torch.tanh(self.pooler(h[:, 0]))
        return out

    def set_activation_checkpointing(self, enabled: bool = True, layers=None) -> None:
        _set_ckpt(self.blocks, enabled, layers)

    def init_weights(self) -> None:
        init_bert_(self, self.config)
        pad_vocab_rows_(self.embeddings.word_embeddings, self.config.vocab_size, self.config.padded_vocab_size)


def init_bert_(module: nn.Module, cfg: BertConfig) -> None:
    if cfg.init == "t-fixup":
        inits.t_fixup_(module, cfg.num_layers, cfg.hidden_size)
    else:
        inits.init_normal_(module, cfg.initializer_range)


def masked_mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over positions whose label is not -100; 0 (not NaN) when a batch has none."""
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits.reshape(flat.numel(), logits.shape[-1]).float(), flat, ignore_index=-100, reduction="sum")
    return total / (flat != -100).sum().clamp(min=1)


class BertForPreTraining(nn.Module):
    """BERT with MLM + NSP heads; ``forward`` follows docs/interfaces.md (mirrors ``transformers.BertForPreTraining``).

    Without ``labels`` it returns the dense ``prediction_logits`` [B, T, V] like transformers; with
    ``labels`` it returns ``masked_prediction_logits`` [n_masked, V] only (see ``forward``).
    """

    config_class = BertConfig
    family = "bert"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertEncoder(config, init=False)  # initialized with the heads below
        self.mlm = MLMHead(config, config.vocab_size)  # the vocabulary is padded after init (models.vocab)
        self.nsp = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def init_weights(self) -> None:
        init_bert_(self, self.config)
        nn.init.zeros_(self.mlm.decoder.bias)
        cfg = self.config
        pad_vocab_rows_(self.bert.embeddings.word_embeddings, cfg.vocab_size, cfg.padded_vocab_size)
        self.tie_weights()
        pad_vocab_rows_(self.mlm.decoder, cfg.vocab_size, cfg.padded_vocab_size)

    def tie_weights(self) -> None:
        self.mlm.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def get_encoder(self) -> BertEncoder:
        return self.bert

    def set_activation_checkpointing(self, enabled: bool = True, layers=None) -> None:
        self.bert.set_activation_checkpointing(enabled, layers)

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, labels=None, next_sentence_label=None,
        masked_positions=None,
    ) -> dict[str, torch.Tensor]:
        out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden = out["last_hidden_state"]
        result = {"seq_relationship_logits": self.nsp(out["pooler_output"])}
        losses = []
        V = self.config.vocab_size  # padded vocabulary rows (models.vocab) are sliced off before any use
        if labels is None:
            result["prediction_logits"] = self.mlm(hidden)[..., :V]
        else:
            # Sparse MLM head (as in NVIDIA's BERT recipe): the vocabulary projection, the largest
            # matmul of small BERTs, runs only at the ~15 % masked positions. The loss equals the
            # dense head's; `masked_prediction_logits` rows follow `labels != -100` in row-major order.
            # `masked_positions` (those positions as flat indices into [B*T], made by the loader on the host)
            # selects the same rows without a boolean mask: a mask's row count is known only on the device,
            # so `hidden[labels != -100]` reads it back (a host sync) and breaks a compiled graph in three.
            if masked_positions is None:
                selected = labels != -100
                masked_hidden, masked_labels = hidden[selected], labels[selected]
            else:
                masked_hidden = hidden.flatten(0, 1).index_select(0, masked_positions)
                masked_labels = labels.flatten().index_select(0, masked_positions)
            masked_logits = self.mlm(masked_hidden)[:, :V]
            result["masked_prediction_logits"] = masked_logits
            result["mlm_loss"] = masked_mean_cross_entropy(masked_logits, masked_labels)
            losses.append(result["mlm_loss"])
        if next_sentence_label is not None:
            result["nsp_loss"] = F.cross_entropy(result["seq_relationship_logits"].float(), next_sentence_label.view(-1))
            losses.append(result["nsp_loss"])
        if losses:
            result["loss"] = sum(losses)
        return result


register_module("bert", BertForPreTraining)

"""Reward models and other sequence classifiers on a decoder: ``LlamaForSequenceClassification``
and ``Qwen2ForSequenceClassification`` (a ``score`` head, no bias, on the last token's final
hidden state).

The decoder runs as for generation (causal attention, tensor and pipeline parallel); the head
has a handful of rows, so every rank of the last stage holds it whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.placement import replicated
from tandem.models.labels import Labels
from tandem.models.llama import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM
from tandem.models.registry import register_model
from tandem.models.stages import PipelineLayout
from tandem.parallel import SINGLE, TPGroup


class ClassifierConfig(LlamaConfig, Labels):
    pass


class _ScoreHead:
    """Replaces the LM head by ``score`` [num_labels, hidden]; pools the last token."""

    config_class = ClassifierConfig
    pipeline = PipelineLayout(layers="layers", first=("embed_tokens",), last=("norm", "score"))
    tasks = frozenset({"embed", "classify"})
    compute_logits = None  # the LM head is replaced by ``score``: no logits to generate from

    def __init__(self, cfg: ClassifierConfig, tp: TPGroup = SINGLE):
        super().__init__(cfg, tp)
        self.lm_head = None
        self.score = nn.Module()
        self.score.weight = replicated((cfg.num_labels, cfg.hidden_size), "score.weight")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.linear(pooled, self.score.weight)

    @staticmethod
    def unused_checkpoint_tensors(cfg: ClassifierConfig) -> set[str]:
        return {
            f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(cfg.num_hidden_layers)
        }


@register_model("LlamaForSequenceClassification")
class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    pass


@register_model("Qwen2ForSequenceClassification")
class Qwen2ForSequenceClassification(_ScoreHead, Qwen2ForCausalLM):
    pass

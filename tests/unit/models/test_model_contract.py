"""The model contract (tandem.models.TandemModel): registration refuses classes that do not
declare it, and every built-in family declares the capabilities it has."""

import pytest
import torch
from pydantic import BaseModel
from torch import nn

from tandem.models import TandemModel, register_model
from tandem.models.bert import BertForSequenceClassification, BertModel
from tandem.models.gpt2 import GPT2LMHeadModel
from tandem.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from tandem.models.moe import MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from tandem.models.registry import model_class, registered_architectures
from tandem.models.reward import LlamaForSequenceClassification
from tandem.models.stages import PipelineLayout
from tandem.models.vit import ViTForImageClassification


class _Config(BaseModel):
    vocab_size: int = 8


class _Complete(TandemModel):
    """Everything the contract asks of a generator."""

    config_class = _Config
    pipeline = PipelineLayout(layers="layers", first=(), last=())
    tasks = frozenset({"generate", "embed"})

    def __init__(self, cfg, tp=None):
        super().__init__()
        self.layers = nn.ModuleList()

    def embed(self, input_ids, positions):
        return input_ids

    def layer_context(self, positions, dtype):
        return None

    def final_norm(self, hidden):
        return hidden

    def compute_logits(self, hidden):
        return hidden

    @staticmethod
    def max_context_len(cfg):
        return 16


def test_a_class_not_subclassing_the_base_is_refused():
    class PlainModule(nn.Module):
        config_class = _Config

    with pytest.raises(TypeError, match=r"PlainModule: it does not subclass .*TandemModel"):
        register_model("PlainModuleForTest")(PlainModule)
    assert model_class("PlainModuleForTest") is None


def test_missing_members_are_listed():
    class NoEmbed(TandemModel):
        config_class = _Config

        def layer_context(self, positions, dtype):
            return None

        @staticmethod
        def max_context_len(cfg):
            return 16

    with pytest.raises(TypeError, match="NoEmbed") as err:
        register_model("NoEmbedForTest")(NoEmbed)
    assert "no pipeline" in str(err.value)
    assert "['embed', 'final_norm']" in str(err.value)
    assert model_class("NoEmbedForTest") is None


def test_declared_tasks_must_match_the_methods():
    class ClaimsClassify(_Complete):
        tasks = frozenset({"generate", "embed", "classify"})

    with pytest.raises(TypeError, match="hold 'classify' but the class has no classify"):
        register_model("ClaimsClassifyForTest")(ClaimsClassify)

    class ForgetsGenerate(_Complete):
        tasks = frozenset({"embed"})

    with pytest.raises(TypeError, match="lack 'generate' but the class defines compute_logits"):
        register_model("ForgetsGenerateForTest")(ForgetsGenerate)

    class ClassifiesWithoutLabels(_Complete):
        tasks = frozenset({"embed", "classify"})
        compute_logits = None

        def classify(self, pooled):
            return pooled

    with pytest.raises(TypeError, match="config_class does not subclass Labels"):
        register_model("ClassifiesWithoutLabelsForTest")(ClassifiesWithoutLabels)

    class PixelsWithoutShape(_Complete):
        inputs = "pixels"

    with pytest.raises(TypeError, match="image_shape"):
        register_model("PixelsWithoutShapeForTest")(PixelsWithoutShape)


def test_a_complete_subclass_registers_with_the_defaults():
    register_model("CompleteForTest")(_Complete)
    assert model_class("CompleteForTest") is _Complete
    assert _Complete.inputs == "tokens" and not _Complete.token_types
    assert _Complete.default_pooling == "last" and _Complete.optional_prefix is None
    assert _Complete.unused_checkpoint_tensors(_Config()) == set()
    assert _Complete.moe_layers(_Config()) == []
    assert _Complete(_Config()).embed(torch.ones(2), None).shape == (2,)


def test_every_built_in_family_subclasses_the_base():
    for arch in registered_architectures():
        assert issubclass(model_class(arch), TandemModel), arch


def test_built_in_families_declare_their_capabilities():
    for generator in (LlamaForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel, Qwen3MoeForCausalLM):
        assert generator.tasks == {"generate", "embed"}, generator
        assert generator.inputs == "tokens" and not generator.token_types
    assert BertModel.tasks == {"embed"}
    assert BertForSequenceClassification.tasks == {"embed", "classify"}
    assert BertModel.token_types and BertModel.default_pooling == "cls"
    assert BertModel.optional_prefix == "bert."
    assert GPT2LMHeadModel.optional_prefix == "transformer."
    assert LlamaForSequenceClassification.tasks == {"embed", "classify"}
    assert LlamaForSequenceClassification.default_pooling == "last"
    assert ViTForImageClassification.inputs == "pixels"
    assert ViTForImageClassification.tasks == {"embed", "classify"}
    assert ViTForImageClassification.default_pooling == "cls"


def test_mixture_of_experts_families_route_experts():
    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        mlp_only_layers=[1],
    )
    assert Qwen3MoeForCausalLM.moe_layers(cfg) == [0, 2, 3]
    assert MixtralForCausalLM.moe_layers(cfg) == [0, 1, 2, 3]
    assert LlamaForCausalLM.moe_layers(cfg) == []

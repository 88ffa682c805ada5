"""Llama-style decoders: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm).

Module names mirror Hugging Face's; each layer's parameters name the canonical tensors they hold.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import model_validator
from torch import nn

from tandem.kernels import decode_stack, gemv, pointwise
from tandem.kernels.decode_stack import DecodeStack, StackLayer, StackShape
from tandem.layers.activation import silu_and_mul
from tandem.layers.attention import Attention, AttentionMetadata
from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.gemm_choice import kernel
from tandem.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, Section
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RopeParameters, RopeTables, RotaryEmbedding, rotate_pair_
from tandem.models.base import TandemModel
from tandem.models.hf_config import HFConfig
from tandem.models.registry import register_model
from tandem.models.stages import PipelineLayout
from tandem.parallel import SINGLE, TPGroup


class LlamaConfig(HFConfig):
    """The ``config.json`` fields a Llama-style model reads (others are ignored)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    hidden_act: Literal["silu"] = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    sliding_window: int | None = None
    use_sliding_window: bool = False

    @model_validator(mode="after")
    def _heads_fit(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads or head_dim set")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope(self) -> RopeParameters:
        if self.rope_parameters is not None:
            return RopeParameters(**self.rope_parameters)
        scaling = dict(self.rope_scaling or {})
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        return RopeParameters(rope_theta=self.rope_theta, **scaling)


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: LlamaConfig, prefix: str, tp: TPGroup, *, qkv_bias: bool, qk_norm: bool
    ):
        super().__init__()
        d = cfg.dim_per_head
        names = tuple(f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj"))
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_attention_heads, cfg.kv_heads, names, bias=qkv_bias, tp=tp
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d,
            cfg.hidden_size,
            f"{prefix}.o_proj.weight",
            f"{prefix}.o_proj.bias" if cfg.attention_bias else None,
            tp,
        )
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, f"{prefix}.q_norm.weight") if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, f"{prefix}.k_norm.weight") if qk_norm else None
        self.heads, self.kv_heads, self.head_dim = (
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            d,
        )
        self.attn = Attention(self.heads, self.kv_heads, d, d**-0.5)

    def forward(self, x, rope: RopeTables, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_pair_(q, k, rope)  # q, k: views of this step's fresh qkv
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, prefix: str, tp: TPGroup):
        super().__init__()
        bias = (lambda n: f"{prefix}.{n}.bias") if cfg.mlp_bias else (lambda n: None)
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [
                Section(f"{prefix}.gate_proj.weight", bias("gate_proj"), cfg.intermediate_size),
                Section(f"{prefix}.up_proj.weight", bias("up_proj"), cfg.intermediate_size),
            ],
            tp,
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            f"{prefix}.down_proj.weight",
            bias("down_proj"),
            tp,
        )

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, prefix: str, tp: TPGroup, mlp: nn.Module, **attn_variant):
        super().__init__()
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.input_layernorm.weight"
        )
        self.self_attn = LlamaAttention(cfg, f"{prefix}.self_attn", tp, **attn_variant)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, f"{prefix}.post_attention_layernorm.weight"
        )
        self.mlp = mlp

    def forward(self, x, rope: RopeTables, meta):
        attn = self.self_attn(self.input_layernorm(x), rope, meta)
        h, normed = self.post_attention_layernorm.add(attn, meta.kept(x))
        return h + self.mlp(normed)


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(TandemModel):
    config_class = LlamaConfig
    tasks = frozenset({"generate", "embed"})
    pipeline = PipelineLayout(layers="layers", first=("embed_tokens",), last=("norm", "lm_head"))
    keeps_rows = True
    qkv_bias: ClassVar[bool | None] = None  # None: follow config ``attention_bias``
    qk_norm: ClassVar[bool] = False

    def __init__(self, cfg: LlamaConfig, tp: TPGroup = SINGLE):
        super().__init__()
        qkv_bias = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, "model.embed_tokens.weight", tp
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                cfg,
                f"model.layers.{i}",
                tp,
                self.make_mlp(cfg, i, tp),
                qkv_bias=qkv_bias,
                qk_norm=self.qk_norm,
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "model.norm.weight")
        self.rotary_emb = RotaryEmbedding(cfg.dim_per_head, cfg.max_position_embeddings, cfg.rope)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, "lm_head.weight", tp, tied_to=tied
        )
        self._decode_stacks: dict[tuple, DecodeStack | None] = {}  # `decode_layers`'

    def make_mlp(self, cfg: LlamaConfig, layer: int, tp: TPGroup) -> nn.Module:
        """Decoder layer ``layer``'s MLP (mixture-of-experts families override this)."""
        return LlamaMLP(cfg, f"model.layers.{layer}.mlp", tp)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def layer_context(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """What every decoder layer shares in one step: the rotary tables."""
        return self.rotary_emb(positions, dtype)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def decode_layers(
        self, layers: list[nn.Module], hidden: torch.Tensor, context: RopeTables, meta
    ) -> torch.Tensor | None:
        """A step of one to `gemv.MAX_ROWS` decode rows through ``layers`` in one C call
        (`tandem.kernels.decode_stack`), where every layer is a plain `LlamaDecoderLayer` on
        one rank and the matmuls of that many rows run on the GEMV kernel: the same kernels
        the layers would call, in the same order."""
        rows = len(hidden)
        if not (
            rows <= gemv.MAX_ROWS
            and hidden.device.type == "cpu"
            and hidden.dtype in decode_stack.DTYPES
            and not torch.is_grad_enabled()
            and meta.decode_only(rows)
            and kernel(hidden.dtype, rows) == "gemv"
            and decode_stack.available()
        ):
            return None
        stack = self._decode_stack(layers, hidden.dtype)
        if stack is None:
            return None
        attns = [layer.self_attn.attn for layer in layers]
        if any(a.k_cache is None for a in attns):
            return None
        caches = [(a.k_cache, a.v_cache) for a in attns]
        return stack.run(hidden, caches, context, meta.slot_mapping, meta.paged)

    def _decode_stack(self, layers: list[nn.Module], dtype: torch.dtype) -> DecodeStack | None:
        """``layers`` as a `DecodeStack` (made on first use: the layers' structure and their
        parameters stay what they were built as), or None where it cannot compute them."""
        key = (tuple(map(id, layers)), dtype)
        if key not in self._decode_stacks:
            self._decode_stacks[key] = _stack_of(layers, dtype)
        return self._decode_stacks[key]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def max_context_len(cfg: LlamaConfig) -> int:
        """Longest sequence computed exactly (tandem has no sliding-window attention yet)."""
        return cfg.max_position_embeddings

    @staticmethod
    def unused_checkpoint_tensors(cfg: LlamaConfig) -> set[str]:
        """Tensors a checkpoint may hold that this model derives instead of reading."""
        names = {
            f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(cfg.num_hidden_layers)
        }
        return names | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())


def _stack_of(layers: list[nn.Module], dtype: torch.dtype) -> DecodeStack | None:
    """``layers`` as a `DecodeStack` where they are what it computes: Llama decoder layers of
    one shape in ``dtype`` on one rank, with a gated MLP, an even head size, no q/k norms, no
    bias past the q/k/v projection, no LoRA and no FP8 weights; else None."""
    first = layers[0] if layers else None
    if not isinstance(first, LlamaDecoderLayer):
        return None
    eps, a0 = first.input_layernorm.eps, first.self_attn
    if a0.head_dim % 2 or a0.head_dim > pointwise.MAX_HEAD_DIM:  # the rotary kernel's
        return None
    stack = []
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
            return None
        a, mlp = layer.self_attn, layer.mlp
        linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (
            a.q_norm is not None
            or (a.heads, a.kv_heads, a.head_dim, a.attn.scale)
            != (a0.heads, a0.kv_heads, a0.head_dim, a0.attn.scale)
            or any(n.eps != eps or n.weight.dtype != dtype for n in norms)
            or any(lin.tp.size != 1 or lin.fp8 is not None or "lora" in lin._modules
                   for lin in linears)
            or any(lin.bias is not None for lin in linears[1:])
            or any(lin.weight.dtype != dtype for lin in linears)
        ):  # fmt: skip
            return None
        stack.append(
            StackLayer(
                layer.input_layernorm.weight,
                a.qkv_proj.weight,
                a.qkv_proj.bias,
                a.o_proj.weight,
                layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight,
                mlp.down_proj.weight,
            )
        )
    shape = StackShape(
        a0.heads, a0.kv_heads, a0.head_dim, first.mlp.down_proj.weight.shape[1], eps, a0.attn.scale
    )
    return DecodeStack(stack, shape, first.input_layernorm.weight.shape[0])


@register_model("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def max_context_len(cfg: LlamaConfig) -> int:
        return min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True

    @staticmethod
    def max_context_len(cfg: LlamaConfig) -> int:
        if cfg.use_sliding_window and cfg.sliding_window:
            return min(cfg.max_position_embeddings, cfg.sliding_window)
        return cfg.max_position_embeddings


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qkv_bias = None
    qk_norm = True

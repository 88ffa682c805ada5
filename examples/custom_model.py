"""A new architecture for tandem, written only from its tensor-parallel layers.

To serve your own architecture:

1. Build the model from ``tandem.layers`` (embeddings, ``ColumnParallelLinear``,
   ``RowParallelLinear``, ``QKVParallelLinear``, ``Attention``, norms). Give every layer the
   canonical names of the checkpoint tensors it holds; the layers record which box of which tensor
   each parameter takes (its placement pieces), so loading and tensor-parallel sharding follow
   with no code in the model, and the layers do their own collectives.
2. Subclass ``tandem.models.TandemModel`` and provide what it lists: ``config_class``,
   ``pipeline``, ``embed``, ``layer_context``, decoder layers called as ``layer(x, context, meta)``,
   ``final_norm`` and ``max_context_len``; declare ``tasks`` (a generator holds ``"generate"``
   and defines ``compute_logits``).
3. Register it with ``@register_model("YourArchitecture")`` (the name in config.json's
   ``architectures``) in an importable module: worker processes import the class's module by
   name, so it must not live in ``__main__``. Import that module before creating the ``LLM``.

Run ``python examples/custom_model.py`` to write a random model of this architecture and generate
from it with two tensor-parallel worker processes. See docs/custom_models.md.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from safetensors.torch import save_file
from torch import nn

from tandem.layers.attention import Attention, AttentionMetadata
from tandem.layers.embedding import ParallelLMHead, PositionEmbedding, VocabParallelEmbedding
from tandem.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, Section
from tandem.layers.norm import RMSNorm
from tandem.layers.placement import canonical_shapes
from tandem.models import TandemModel, register_model
from tandem.models.stages import PipelineLayout
from tandem.models.tiny import EOS, train_tokenizer
from tandem.parallel import SINGLE, TPGroup

if __name__ == "__main__":
    # Run as a script, this file is ``__main__``, and worker processes cannot import a class from
    # there. Import it under its own name (its folder is on sys.path, which the workers inherit)
    # and run that copy instead, before this one registers anything.
    import custom_model

    custom_model.main()
    sys.exit(0)

ARCHITECTURE = "TinyParallelLMForCausalLM"


class TinyParallelLMConfig(BaseModel):
    """The ``config.json`` fields this architecture reads (others are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_positions: int = 256
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: TinyParallelLMConfig, prefix: str, tp: TPGroup):
        super().__init__()
        d = cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, f"{prefix}.attn_norm.weight")
        # q, k, v are three canonical tensors; each rank holds its heads' rows of each.
        self.qkv = QKVParallelLinear(
            cfg.hidden_size,
            d,
            cfg.num_heads,
            cfg.num_heads,
            (f"{prefix}.attn.q", f"{prefix}.attn.k", f"{prefix}.attn.v"),
            bias=False,
            tp=tp,
        )
        self.heads = self.qkv.num_heads  # this rank's share
        self.head_dim = d
        self.attn = Attention(self.heads, self.heads, d, d**-0.5)
        # Input columns split across ranks; the partial sums are all-reduced inside the layer.
        self.out = RowParallelLinear(
            cfg.num_heads * d, cfg.hidden_size, f"{prefix}.attn.out.weight", None, tp
        )
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, f"{prefix}.mlp_norm.weight")
        self.up = ColumnParallelLinear(
            cfg.hidden_size,
            [Section(f"{prefix}.mlp.up.weight", f"{prefix}.mlp.up.bias", cfg.intermediate_size)],
            tp,
        )
        self.down = RowParallelLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            f"{prefix}.mlp.down.weight",
            f"{prefix}.mlp.down.bias",
            tp,
        )

    def forward(self, x: torch.Tensor, context: None, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (t.view(-1, self.heads, self.head_dim) for t in self.qkv(self.attn_norm(x)))
        h = x + self.out(self.attn(q, k, v, meta).flatten(1))
        return h + self.down(F.gelu(self.up(self.mlp_norm(h))))


@register_model(ARCHITECTURE)
class TinyParallelLMForCausalLM(TandemModel):
    config_class = TinyParallelLMConfig
    tasks = frozenset({"generate", "embed"})
    pipeline = PipelineLayout(layers="blocks", first=("tokens", "positions"), last=("norm", "head"))

    def __init__(self, cfg: TinyParallelLMConfig, tp: TPGroup = SINGLE):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        self.tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, "tokens.weight", tp)
        self.positions = PositionEmbedding(cfg.max_positions, cfg.hidden_size, "positions.weight")
        self.blocks = nn.ModuleList(Block(cfg, f"blocks.{i}", tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, "norm.weight")
        self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, "head.weight", tp)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tokens(input_ids) + self.positions(positions)

    def layer_context(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        return None  # positions are added once, in `embed`; no rotary tables to share

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @staticmethod
    def max_context_len(cfg: TinyParallelLMConfig) -> int:
        return cfg.max_positions


def write_random_model(path: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a random-init model of this architecture in Hugging Face layout to ``path``:
    config.json, generation_config.json, model.safetensors and tokenizer.json."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TinyParallelLMConfig(**config_overrides)
    tok = train_tokenizer(cfg.vocab_size, seed)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab_size")
    eos = tok.token_to_id(EOS)
    config = {"architectures": [ARCHITECTURE], **cfg.model_dump()}
    config.update(bos_token_id=eos, eos_token_id=eos, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": eos}, indent=2)
    )
    tok.save(str(out / "tokenizer.json"))

    # The tensor names and shapes come from the model's own placement pieces (no storage needed).
    with torch.device("meta"):
        shapes = canonical_shapes(TinyParallelLMForCausalLM(cfg))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=gen)
        if name.endswith(".bias"):
            tensors[name] = 0.1 * noise
        elif len(shape) == 1:  # norm scales
            tensors[name] = 1.0 + 0.1 * noise
        else:
            tensors[name] = noise / math.sqrt(cfg.hidden_size)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    from tandem import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(tmp)
        with LLM(model_dir, tensor_parallel_size=2) as llm:
            params = SamplingParams(max_tokens=16, temperature=0)
            for out in llm.generate(["The quick dog", "12 + 7 ="], params):
                print(f"{out.prompt!r} -> {out.outputs[0].text!r}")

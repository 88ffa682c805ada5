"""The custom-architecture example (examples/custom_model.py): its model computes what an
independent plain-torch forward computes from the same files, and tensor parallelism changes
nothing."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from support.paths import REPO
from tandem import LLM, SamplingParams

sys.path.insert(0, str(REPO / "examples"))
import custom_model  # noqa: E402  (registers TinyParallelLMForCausalLM; workers inherit sys.path)

# An uneven vocabulary: the last tensor-parallel rank's vocab shard is short.
CONFIG = dict(vocab_size=509, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
PROMPTS = ["The quick dog", "12 + 7 =", "Every policy learns from the reward"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return custom_model.write_random_model(tmp_path_factory.mktemp("custom"), seed=3, **CONFIG)


def reference_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """The architecture written out by hand, unsharded, from the checkpoint's tensors."""
    w = load_file(str(model_dir / "model.safetensors"))
    cfg = custom_model.TinyParallelLMConfig(**CONFIG)
    n, heads, d = len(ids), cfg.num_heads, cfg.hidden_size // cfg.num_heads

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w[name]

    x = w["tokens.weight"][ids] + w["positions.weight"][:n]
    causal = torch.ones(n, n).tril().bool()
    for i in range(cfg.num_layers):
        p = f"blocks.{i}"
        h = rms(x, f"{p}.attn_norm.weight")
        q, k, v = (
            (h @ w[f"{p}.attn.{t}.weight"].T).view(n, heads, d).transpose(0, 1) for t in "qkv"
        )
        scores = (q @ k.transpose(1, 2)) / d**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = (probs @ v).transpose(0, 1).reshape(n, heads * d)
        x = x + attn @ w[f"{p}.attn.out.weight"].T
        h = rms(x, f"{p}.mlp_norm.weight")
        up = F.gelu(h @ w[f"{p}.mlp.up.weight"].T + w[f"{p}.mlp.up.bias"])
        x = x + up @ w[f"{p}.mlp.down.weight"].T + w[f"{p}.mlp.down.bias"]
    return rms(x, "norm.weight") @ w["head.weight"].T


@pytest.mark.timeout(240)
def test_logits_match_an_unsharded_reference(model_dir):
    with LLM(model_dir) as llm:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        gen = torch.Generator().manual_seed(0)
        prompts.append(torch.randint(0, CONFIG["vocab_size"], (40,), generator=gen).tolist())
        for ids in prompts:
            got = llm.score([ids], logprobs=False)[0]
            want = reference_logits(model_dir, ids)
            assert got.shape == (len(ids), CONFIG["vocab_size"])
            assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.timeout(240)
def test_tensor_parallel_generation_matches_single_process(model_dir):
    with LLM(model_dir) as llm:
        expected = llm.generate(PROMPTS, GREEDY)
    with LLM(model_dir, tensor_parallel_size=2) as llm:
        assert len(llm.worker_locations()) == 2
        got = llm.generate(PROMPTS, GREEDY)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert len(g.outputs[0].token_ids) == 12
        pairs = zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True)
        assert max(abs(a - b) for a, b in pairs) <= 1e-5

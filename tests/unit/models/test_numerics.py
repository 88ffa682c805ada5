"""tandem vs Hugging Face transformers on the same directories (the independent reference)."""

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams

CONFIGS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-odd-heads-tied-bias": (
        "llama",
        dict(
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "llama3-rope-scaling": (
        "llama",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": (
        "llama",
        dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
    ),
    "qwen2-qkv-bias-tied": ("qwen2", {}),
    "qwen2-untied-6-heads": (
        "qwen2",
        dict(
            hidden_size=96, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False
        ),
    ),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-odd-heads": (
        "qwen3",
        dict(num_attention_heads=5, num_key_value_heads=1, head_dim=16),
    ),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-dense-first-unnormalised": (
        "qwen3_moe",
        dict(mlp_only_layers=[0], norm_topk_prob=False, num_experts=7, num_experts_per_tok=3),
    ),
    "qwen3-moe-sparse-step-2": ("qwen3_moe", dict(decoder_sparse_step=2)),
    "mixtral": ("mixtral", {}),
    "gpt2-tied": ("gpt2", {}),
    "gpt2-untied-3-heads-gelu": (
        "gpt2",
        dict(n_embd=48, n_head=3, tie_word_embeddings=False, activation_function="gelu"),
    ),
}

PROMPT_LENGTHS = [1, 5, 17, 40]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, model_factory):
    family, overrides = CONFIGS[request.param]
    path = model_factory(family, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32")
    gen = torch.Generator().manual_seed(1)
    vocab = llm.engine.spec.vocab_size
    eos = set(llm.engine.spec.eos_token_ids)
    prompts = []
    for n in PROMPT_LENGTHS:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        prompts.append([t if t not in eos else t + 1 for t in ids])
    yield llm, ref, prompts
    llm.shutdown()


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers(pair):
    llm, ref, prompts = pair
    ours = llm.score(prompts, logprobs=False)
    for ids, logits in zip(prompts, ours, strict=True):
        expected = _ref_logits(ref, ids)
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() <= 1e-4


def test_greedy_32_tokens_match_transformers_generate(pair):
    llm, ref, prompts = pair
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    eos = llm.engine.spec.eos_token_ids[0]
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            full = ref.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=32, pad_token_id=eos
            )[0]
        expected = full[len(ids) :].tolist()
        assert out.outputs[0].token_ids == expected
        assert len(expected) == 32 or expected[-1] == eos


def test_sampled_logprobs_equal_reference_log_softmax(pair):
    llm, ref, prompts = pair
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0].token_ids
        assert len(gen) == 12 and len(out.outputs[0].logprobs) == 12
        logp = torch.log_softmax(_ref_logits(ref, ids + gen), dim=-1)
        expected = logp[len(ids) - 1 : -1].gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        got = torch.tensor(out.outputs[0].logprobs)
        assert (got - expected).abs().max().item() <= 1e-4

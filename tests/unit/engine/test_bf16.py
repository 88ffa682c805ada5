"""``dtype="bfloat16"`` against transformers run in bfloat16, on tiny models (hidden 64, a few
dozen tokens: fast on CPUs without bfloat16 units too): decoders single process (logits,
generated and prompt log-probs), TP=2, PP=2, with the prefix cache hit, mixture-of-experts
models, and encoders (BERT classify and embed, a decoder reward model).

Tolerance (`bf16_tolerance`): `ULPS` units in the last place of bfloat16 at the reference
output's largest magnitude (at least 1). bfloat16 keeps 8 significant bits, so a value in
[2^e, 2^(e+1)) is a multiple of 2^(e-7), and every layer's output is rounded to that. Two correct
bfloat16 implementations that round the same arithmetic at different points (a tensor-parallel
partial sum added in bfloat16, a GEMM blocked differently on a worker's one thread) end a few
such units apart: up to 2.1 seen here (TP=2), 0 for single-process Llama (bit-equal logits).
Log-probs are log_softmax in float32 of the bfloat16 logits on both sides, so they carry the
logits' difference. Greedy tokens are compared where the margin allows: each token the engine
picked is transformers' argmax at that position or within the tolerance of it (teacher-forced
on the engine's tokens, so one near-tie does not derail the rest of the run).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.rl import replay_routing
from tandem.rl.replay import moe_routers

pytestmark = pytest.mark.timeout(300)
ULPS = 4
PROMPTS = [
    [5],
    [100, 3, 8, 41, 250],
    [17, 2, 9, 33, 70, 12, 1, 88, 45, 6, 19, 23, 300, 4, 61],
    list(range(10, 50)),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)


def bf16_tolerance(reference: torch.Tensor) -> float:
    """`ULPS` bfloat16 units in the last place at the reference's largest magnitude (>= 1)."""
    scale = max(reference.abs().max().item(), 1.0)
    return ULPS * 2.0 ** (math.floor(math.log2(scale)) - 7)


def _hf(path: str, cls=transformers.AutoModelForCausalLM):
    return cls.from_pretrained(path, dtype=torch.bfloat16).eval()


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _check_completion(ref, prompt: list[int], completion, greedy: bool) -> None:
    """The engine's log-probs (and greedy picks) against transformers' forward over prompt +
    completion."""
    tokens = torch.tensor(completion.token_ids)
    logits = _ref_logits(ref, prompt + completion.token_ids)[len(prompt) - 1 : -1]
    tol = bf16_tolerance(logits)
    expected = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert (torch.tensor(completion.logprobs) - expected).abs().max().item() <= 2 * tol
    if greedy:  # the picked token's logit is the reference's best, up to bfloat16 rounding
        picked = logits.gather(1, tokens[:, None]).squeeze(1)
        assert (logits.max(dim=-1).values - picked).max().item() <= tol


def _check_generation(llm, ref, prompts=PROMPTS) -> None:
    assert llm.dtype == "bfloat16"
    for params in (GREEDY, SAMPLED):
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            _check_completion(ref, prompt, out.outputs[0], params.temperature == 0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_single_process_matches_transformers_bf16(model_factory, family):
    path = model_factory(family)
    ref = _hf(path)
    with LLM(path, dtype="bfloat16") as llm:
        dtypes = llm.apply_model(lambda model: {p.dtype for p in model.parameters()})
        assert dtypes == [{torch.bfloat16}]
        for ids, logits in zip(PROMPTS, llm.score(PROMPTS, logprobs=False), strict=True):
            expected = _ref_logits(ref, ids)
            assert (logits.float() - expected).abs().max().item() <= bf16_tolerance(expected)
        _check_generation(llm, ref)
        scored = llm.generate(PROMPTS[1:], SamplingParams(max_tokens=1, prompt_logprobs=0))
        for ids, out in zip(PROMPTS[1:], scored, strict=True):
            logits = _ref_logits(ref, ids)[:-1]
            lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
            got = torch.tensor(out.prompt_logprobs[1:])
            assert (got - lp.squeeze(1)).abs().max().item() <= 2 * bf16_tolerance(logits)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_ranks_match_transformers_bf16(llama_dir, tp, pp):
    with LLM(
        llama_dir, dtype="bfloat16", tensor_parallel_size=tp, pipeline_parallel_size=pp
    ) as llm:
        assert {lay.dtype for lay in llm.engine.target.weight_layouts()} == {"bfloat16"}
        _check_generation(llm, _hf(llama_dir))


def test_prefix_cache_hits_match_transformers_bf16(llama_dir):
    """Prompts sharing 40 tokens, 3 samples each, twice: the second run reads the first one's
    cached bfloat16 KV blocks."""
    shared = list(range(60, 100))
    prompts = [shared + [7, 8], shared + [250, 3, 9]]
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, logprobs=0, ignore_eos=True)
    ref = _hf(llama_dir)
    with LLM(llama_dir, dtype="bfloat16", enable_prefix_caching=True) as llm:
        first = llm.generate(prompts, params)
        hits = llm.engine.stats().prefix_cache_hit_tokens
        again = llm.generate(prompts, params)
        assert llm.engine.stats().prefix_cache_hit_tokens > hits
    for run in (first, again):
        for prompt, out in zip(prompts, run, strict=True):
            for completion in out.outputs:
                _check_completion(ref, prompt, completion, greedy=False)


@pytest.mark.parametrize(("family", "tp"), [("qwen3_moe", 1), ("mixtral", 1), ("qwen3_moe", 2)])
def test_moe_matches_transformers_bf16_under_the_engines_routing(model_factory, family, tp):
    """Top-k routing is discontinuous: a bfloat16 rounding difference can flip a near-tie
    between two experts and move everything after it. One-token prompts make every position
    one whose routing the engine reports; transformers replays it (`replay_routing`), and the
    log-probs must agree within the tolerance. Where the engine's experts differ from
    transformers' own top-k, the router's k-th and (k+1)-th logits must be a near-tie."""
    path = model_factory(family)
    ref = _hf(path)
    k = ref.config.num_experts_per_tok
    prompts = [[5], [100], [33], [250]]
    params = SamplingParams(
        max_tokens=12, temperature=0, logprobs=0, ignore_eos=True, return_routed_experts=True
    )
    with LLM(path, dtype="bfloat16", tensor_parallel_size=tp) as llm:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        for layer, logits in enumerate(_replayed_router_logits(ref, prompt, c)):
            for pos, row in enumerate(logits[: len(c.token_ids)]):
                top = row.topk(k + 1).values
                if sorted(row.topk(k).indices.tolist()) != sorted(c.routed_experts[pos][layer]):
                    assert top[k - 1] - top[k] <= bf16_tolerance(row)


def _replayed_router_logits(ref, prompt: list[int], completion) -> list[torch.Tensor]:
    """Checks ``completion`` against transformers routed as the engine routed it; returns
    transformers' router logits in that forward, one [tokens, experts] tensor per MoE layer."""
    seen = []
    hooks = [
        r.register_forward_hook(lambda m, i, o: seen.append(o[0].float())) for r in moe_routers(ref)
    ]
    try:
        with replay_routing(ref, [completion.routed_experts], [0]):
            _check_completion(ref, prompt, completion, greedy=True)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


TEXTS = ["The quick dog runs", "a", "Every policy learns from the reward near the river"]


@pytest.mark.parametrize(
    ("family", "task", "tp"),
    [
        ("bert", "classify", 1),
        ("bert", "classify", 2),
        ("bert", "embed", 1),
        ("llama_reward", "classify", 1),
    ],
)
def test_encoders_match_transformers_bf16(model_factory, family, task, tp):
    embed = task == "embed"
    path = model_factory(family, **({"architectures": ["BertModel"]} if embed else {}))
    hf = _hf(
        path, transformers.BertModel if embed else transformers.AutoModelForSequenceClassification
    )
    with LLM(path, task=task, dtype="bfloat16", tensor_parallel_size=tp) as llm:
        assert llm.dtype == "bfloat16"
        rows = llm.embed(TEXTS) if embed else llm.classify(TEXTS)
        for text, row in zip(TEXTS, rows, strict=True):
            with torch.no_grad():
                out = hf(torch.tensor([llm.engine.tokenizer.encode(text)]))
            want = (out.last_hidden_state[0, 0] if embed else out.logits[0]).float()
            assert (torch.tensor(row) - want).abs().max().item() <= bf16_tolerance(want)

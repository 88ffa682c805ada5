"""What the vLLM tests (tests/integrations/vllm) share: the small models they build, their
prompts, a trainer's new policy (every weight moved by a seeded amount), an offline engine made
as they make it, and the check that vLLM generates what transformers does on given weights.

Imports vLLM only when called (each test sets vLLM's environment before importing it); a script
in this folder started by path imports it by bare name (``from vllm_models import moved``).
"""

from __future__ import annotations

import gc
import os

import torch

# vLLM's CPU attention takes head sizes 32 and up (not 16)
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
MODEL = {**SHAPE, "tie_word_embeddings": False}  # a llama with its own lm_head
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
NEW = 6  # tokens generated per prompt
ONE_CORE_PER_RANK = "|".join(map(str, sorted(os.sched_getaffinity(0))[:2]))  # vLLM's TP=2 bind


def train_step(model: torch.nn.Module, seed: int) -> None:
    """Every weight moved by a seeded amount, in place: a new policy."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def moved(model_dir: str, seed: int) -> torch.nn.Module:
    """The model directory's model with every weight moved by a seeded amount (`train_step`)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train_step(model, seed)
    return model.eval()


def offline_llm(model_dir: str, tp: int = 1, **options):
    """An offline ``vllm.LLM`` of ``model_dir`` as the tests make it (float32, 128 tokens, 8 MiB
    of KV cache, eager, seed 0), with ``options`` (the weight-transfer backend or the worker
    extension). ``tp`` 2: its workers are processes, a core each (`engine_gone` undoes it)."""
    import vllm

    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ONE_CORE_PER_RANK
    vllm.envs.disable_envs_cache()  # an earlier engine froze the environment vLLM reads
    return vllm.LLM(
        model_dir,
        dtype="float32",
        tensor_parallel_size=tp,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        enforce_eager=True,
        seed=0,
        **options,
    )


def engine_gone() -> None:
    """Once its caller dropped its last reference to an `offline_llm` engine: collect it now
    (the next in-process engine sets vLLM's parallel state up anew, and a late collection would
    tear that down) and undo its cores' binding."""
    gc.collect()
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def generate(llm, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    """vLLM's greedy tokens for ``prompts`` and their log-probs."""
    import vllm

    params = vllm.SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(
        [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    out = [o.outputs[0] for o in outs]
    return [
        (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        for c in out
    ]


def assert_generates_like(
    llm, model: torch.nn.Module, logprobs: bool = True, prompts: list[list[int]] = PROMPTS
) -> None:
    """vLLM's greedy tokens for ``prompts`` are transformers' on ``model``, log-probs (unless
    not ``logprobs``) within float32 noise."""
    for ids, (tokens, got) in zip(prompts, generate(llm, prompts), strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
        if logprobs:
            expected = torch.log_softmax(logits, -1)[torch.arange(NEW), tokens]
            assert torch.allclose(torch.tensor(got), expected, atol=1e-3)

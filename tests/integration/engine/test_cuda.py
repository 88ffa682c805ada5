"""The engine on a CUDA device (the GPU tier, `make test-gpu`; CI has no GPU): it decodes what
transformers does on the same weights, dense and mixture-of-experts, at TP=2 where two GPUs
are present; a block-FP8 engine serves what the same engine serves on the CPU (whose FP8 path
is held to the reference quantization by test_fp8.py); a LoRA adapter serves what PEFT's merged
model does."""

import pytest
import torch
import transformers

from support.lora_refs import greedy, merged, peft_model, save_adapter
from tandem import LLM, LoRARequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
TOL = 1e-3  # float32 on a GPU: other kernels, other summation orders


def _reference_logprobs(reference, out) -> torch.Tensor:
    """transformers' log-probs (float32, CPU) of the tokens ``out`` generated."""
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
    n = len(out.prompt_token_ids)
    chosen = torch.tensor(out.outputs[0].token_ids)[:, None]
    return logp[n - 1 : -1].gather(1, chosen).squeeze(1)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_engine_on_cuda_decodes_what_transformers_does(model_factory, family, tp):
    if tp > torch.cuda.device_count():
        pytest.skip(f"needs {tp} GPUs")
    path = model_factory(family)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with LLM(path, device="cuda", dtype="float32", tensor_parallel_size=tp) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    for out in outs:
        got = torch.tensor(out.outputs[0].logprobs)
        assert (got - _reference_logprobs(reference.eval(), out)).abs().max() <= TOL
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_a_block_fp8_engine_on_cuda_serves_what_it_serves_on_the_cpu(llama_dir):
    def run(device: str):
        with LLM(llama_dir, device=device, dtype="float32", quantization="fp8") as llm:
            return [
                (o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(PROMPTS, GREEDY)
            ]

    on_cpu, on_cuda = run("cpu"), run("cuda")
    for (cpu_ids, cpu_logprobs), (cuda_ids, cuda_logprobs) in zip(on_cpu, on_cuda, strict=True):
        assert cuda_ids == cpu_ids
        assert max(abs(a - b) for a, b in zip(cuda_logprobs, cpu_logprobs, strict=True)) <= TOL


def test_a_lora_adapter_on_cuda_serves_what_the_merged_peft_model_does(llama_dir, tmp_path):
    model = peft_model(llama_dir, seed=3)
    path = save_adapter(model, tmp_path / "adapter")
    reference = merged(model)
    with LLM(
        llama_dir, device="cuda", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 1, path))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logprobs = greedy(reference, prompt, GREEDY.max_tokens)
        assert out.outputs[0].token_ids == tokens
        got = out.outputs[0].logprobs
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) <= TOL

"""CUDA paths of the weight exchange: cuda_ipc and dist over NCCL (run on a GPU machine)."""

import subprocess
import sys

import pytest
import torch
import transformers

from support.paths import SUPPORT
from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _data_ptrs(model) -> dict[str, int]:
    """Where each parameter's storage lives (a push in place keeps it)."""
    return {n: p.data_ptr() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("transport", "tp"), [("cuda_ipc", 1), ("cuda_ipc", 2), ("dist", 1)])
def test_gpu_trainer_pushes_into_cuda_engine(model_factory, transport, tp):
    if tp > torch.cuda.device_count():
        pytest.skip(f"needs {tp} GPUs")
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    script = SUPPORT / "gpu_trainer.py"
    reference = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir).eval()
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(engine_dir, device="cuda", tensor_parallel_size=tp) as llm:
        before = llm.apply_model(_data_ptrs)[0] if tp == 1 else None
        done = subprocess.run(
            [sys.executable, str(script), trainer_dir, llm.exchange_address, "4", transport],
            timeout=240,
        )
        assert done.returncode == 0
        assert llm.weight_version == 4
        if before is not None:
            assert llm.apply_model(_data_ptrs) == [before]
        out = llm.generate([[5, 9, 33, 2, 17]], params)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
    n = len(out.prompt_token_ids)
    expected = logp[n - 1 : -1].gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])
    assert (torch.tensor(out.outputs[0].logprobs) - expected.squeeze(1)).abs().max() <= 1e-3


def test_gpu_cuda_ipc_wrong_copy_is_rejected_and_the_old_weights_keep_serving(model_factory):
    """The trainer's writer shifts every box by a row (honest CRC32s): the engine's check of
    the CUDA staging buffer rejects the push before commit."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    script = SUPPORT / "gpu_trainer.py"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(engine_dir, device="cuda") as llm:
        before = llm.generate([[5, 9, 33, 2, 17]], params)[0].outputs[0].token_ids
        done = subprocess.run(
            [
                sys.executable,
                str(script),
                trainer_dir,
                llm.exchange_address,
                "1",
                "cuda_ipc",
                "shifted",
            ],
            timeout=240,
        )
        assert done.returncode == 3 and llm.weight_version == 0
        after = llm.generate([[5, 9, 33, 2, 17]], params)[0].outputs[0].token_ids
        assert after == before

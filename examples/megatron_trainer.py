"""Push a megatron-core GPTModel's weights into a tandem engine, from every trainer rank.

Run one process per rank, e.g. TP=2 on one host (CPU, gloo; on GPUs use nccl):

    torchrun --nproc-per-node 2 examples/megatron_trainer.py ADDRESS

ADDRESS is an engine's ``llm.exchange_address`` (an `LLM` in another process on this host) or a
`tandem serve` URL (``http://127.0.0.1:8000`` with ``$TANDEM_ADMIN_KEY``). The engine must
serve the Hugging Face model the GPTModel below mirrors (here: a Llama with these sizes).
``tests/megatron_trainer.py`` is the tested version of this, with CPU shims for megatron-core.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from tandem.exchange import WeightSender

VOCAB = 32000  # the tokenizer's; Megatron pads its embedding (rows past VOCAB are never sent)


def main(address: str) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=176, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, layernorm_epsilon=1e-6,
        tensor_model_parallel_size=dist.get_world_size(),
    )  # fmt: skip
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32128,
                     max_sequence_length=512, position_embedding_type="rope")  # fmt: skip
    # ... train ...
    sender = WeightSender(model, address, vocab_size=VOCAB)  # layout="auto" finds Megatron
    for step in range(1, 4):
        # optimizer.step() here
        stats = sender.push(version=step)  # every rank, collectively
        if dist.get_rank() == 0:
            print(f"step {step}: {stats.bytes_sent} bytes from rank 0 in {stats.seconds:.3f} s")


if __name__ == "__main__":
    main(sys.argv[1])

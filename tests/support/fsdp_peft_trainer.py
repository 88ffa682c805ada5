"""A 2-rank FSDP2 trainer (gloo) holding a PEFT LoRA model; pushes only its adapter.

python tests/support/fsdp_peft_trainer.py RANK PORT MODEL_DIR ADAPTER_DIR EXCHANGE_ADDRESS
"""

import sys

import peft
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tandem.exchange import WeightSender


def main() -> int:
    rank, rendezvous, model_dir, adapter_dir, address = sys.argv[1:6]
    rank = int(rank)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(isinstance(p, DTensor) for p in lora)
    stats = WeightSender(model, address, lora_name="policy").push(version=1)
    print(f"rank {rank}: pushed {stats.bytes_sent} bytes of the adapter", flush=True)
    assert stats.bytes_moved == stats.bytes_needed
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A 2-rank FSDP2 trainer (gloo) that pushes its weights into an engine; run by the tests.

    python tests/support/fsdp_trainer.py RANK PORT MODEL_DIR EXCHANGE_ADDRESS VERSION TRANSPORT \
        MODE [die]

Exits 0 when pushed, 3 when the push failed, 4 when it was refused as stale
(`StaleVersionError`). With ``die``, rank 1 is killed mid-push: with shm after it staged (or
wrote in place) its boxes and before it told the engine; with dist after sending engine rank 0
its boxes and before engine rank 1's.
"""

import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import sender_faults  # (this script's directory)
from tandem.exchange import StaleVersionError, WeightSender, WeightSyncError


def main() -> int:
    rank, rendezvous, model_dir, address, version, transport, mode = sys.argv[1:8]
    die = len(sys.argv) > 8 and sys.argv[8] == "die"
    rank = int(rank)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if die and rank == 1:  # delivers, then dies before telling the engine the push is ready
        if transport == "dist":  # only the first engine rank gets its boxes
            sender_faults.deliver_to_first_engine_rank()
        sender_faults.die_before_ready()
    try:
        sender = WeightSender(model, address, transport=transport, mode=mode)
        stats = sender.push(version=int(version))
    except WeightSyncError as exc:
        print(f"rank {rank}: push failed: {exc}", flush=True)
        return 3
    except StaleVersionError as exc:
        print(f"rank {rank}: push refused: {exc}", flush=True)
        return 4
    print(f"rank {rank}: pushed version {stats.version}, {stats.bytes_sent} bytes", flush=True)
    assert stats.bytes_moved == stats.bytes_needed
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

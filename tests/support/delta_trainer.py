"""A 2-rank FSDP2 trainer (gloo) taking AdamW steps at an RL learning rate and pushing each
version as a delta; run by the tests.

    python tests/support/delta_trainer.py RANK RENDEZVOUS MODEL_DIR ADDRESS PUSHES TRANSPORT \
        MODE OUT_DIR

Pushes versions 1 .. PUSHES (`delta=True`: the first goes dense), one AdamW step (lr 1e-5,
the same batch on both ranks) before each after the first. Rank 0 writes OUT_DIR/pushes.json
(per push: delta, why_dense, bytes_moved, bytes_needed, summed over the ranks) and the
trainer's final weights as a Hugging Face checkpoint in OUT_DIR/ckpt (the reference).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tandem.exchange import WeightSender


def main() -> int:
    rank, rendezvous, model_dir, address, pushes, transport, mode, out = sys.argv[1:9]
    rank, pushes, out = int(rank), int(pushes), Path(out)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batches = torch.Generator().manual_seed(1)
    sender = WeightSender(model, address, transport=transport, mode=mode)
    record = []
    for version in range(1, pushes + 1):
        if version > 1:
            ids = torch.randint(0, 100, (2, 12), generator=batches)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        stats = sender.push(version=version, delta=True)
        sent = torch.tensor([stats.bytes_sent])
        dist.all_reduce(sent)
        record.append(
            {
                "delta": stats.delta,
                "why_dense": stats.why_dense,
                "bytes_moved": stats.bytes_moved,
                "bytes_sent": int(sent),
                "bytes_needed": stats.bytes_needed,
            }
        )
    sender.close()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        (out / "pushes.json").write_text(json.dumps(record))
        model.save_pretrained(out / "ckpt", state_dict=full)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(model_dir) / name, out / "ckpt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

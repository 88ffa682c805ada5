"""A 2-rank FSDP2 trainer (gloo) that pushes into a ``vllm serve`` with the ``tandem`` backend
through vLLM's own trainer API and HTTP client; run by
tests/integrations/vllm/test_vllm_backend_serve.py.

    python vllm_backend_trainer.py RANK PORT MODEL_DIR URL VERSION SEED [die|corrupt]

Its weights: the model directory's, each moved by ``seed`` (`moved`; the test computes the
same on its side). Exits 0 when pushed, 3 when the push failed. With ``die``, rank 0 (which
drives vLLM's protocol) is killed once its first ``update_weights`` call returned: vLLM's
workers hold a verified push that nobody will commit. With ``corrupt``, rank 1 writes every
box one row off (its CRC32s stay honest: of what it read).
"""

import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from faulty_writes import faulty_sender, shifted  # noqa: E402  (this script's directory)
from tandem.exchange import WeightSyncError
from tandem.exchange.transports.base import SenderHalf
from tandem.integrations.vllm import TandemTrainerInitInfo


def moved(model_dir: str, seed: int) -> torch.nn.Module:
    """The model directory's model, every weight moved by a seeded amount."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


class DiesAfterFirstUpdate(HTTPVLLMWeightSyncClient):
    def update_weights(self, update_info) -> None:
        super().update_weights(update_info)
        os._exit(9)


def main() -> int:
    rank, port, model_dir, url, version, seed = sys.argv[1:7]
    fault = sys.argv[7] if len(sys.argv) > 7 else None
    die = fault == "die"
    rank = int(rank)
    if fault == "corrupt" and rank == 1:
        SenderHalf.write_box = faulty_sender(shifted)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = moved(model_dir, int(seed))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    client = (DiesAfterFirstUpdate if die else HTTPVLLMWeightSyncClient)(url, timeout=120)
    engine = WeightTransferTrainerFactory.trainer_init(
        TandemTrainerInitInfo(rank=rank, world_size=2), client=client, source=ModuleSource(model)
    )
    try:
        stats = engine.send_weights(version=int(version))
    except WeightSyncError as exc:
        print(f"rank {rank}: push failed: {exc}", flush=True)
        return 3
    finally:
        engine.shutdown()
    print(f"rank {rank}: pushed version {stats.version}, {stats.bytes_sent} bytes", flush=True)
    assert stats.bytes_moved == stats.bytes_needed
    assert len(stats.bytes_by_receiver) == 2  # rank's boxes went to each worker's slices
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A 2-rank FSDP2 trainer (gloo) that pushes into a ``vllm serve`` with the ``tandem`` backend
through vLLM's own trainer API and HTTP client; run by
tests/integrations/vllm/test_vllm_backend_serve.py.

    python vllm_backend_trainer.py RANK PORT MODEL_DIR URL VERSION SEED [die|corrupt]

Its weights: the model directory's, each moved by ``seed`` (`vllm_models.moved`, as the test
computes them on its side). Exits 0 when pushed, 3 when the push failed. With ``die``, rank 0
(which drives vLLM's protocol) is killed once the first phase of its push returned (the
``update_weights`` call after the workers' version check): vLLM's
workers hold a verified push that nobody will commit. With ``corrupt``, rank 1 writes every
box one row off (its CRC32s stay honest: of what it read).
"""

import base64
import os
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from faulty_writes import faulty_sender, shifted  # noqa: E402  (this script's directory)
from tandem.exchange import WeightSyncError
from tandem.exchange.transports.base import SenderHalf
from tandem.integrations.vllm import TandemTrainerInitInfo
from tandem.integrations.vllm.messages import VLLM, VersionCheck
from vllm_models import moved  # noqa: E402  (this script's directory)


class DiesAfterFirstUpdate(HTTPVLLMWeightSyncClient):
    def update_weights(self, update_info) -> None:
        super().update_weights(update_info)
        request = VLLM.decode(base64.b64decode(update_info[0]["phase_request"]))
        if not isinstance(request, VersionCheck):  # a push's first phase, not its check
            os._exit(9)


def main() -> int:
    rank, rendezvous, model_dir, url, version, seed = sys.argv[1:7]
    fault = sys.argv[7] if len(sys.argv) > 7 else None
    die = fault == "die"
    rank = int(rank)
    if fault == "corrupt" and rank == 1:
        SenderHalf.write_box = faulty_sender(shifted)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
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

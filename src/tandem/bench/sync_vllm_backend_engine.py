"""The vLLM side of `tandem bench sync --into vllm`'s backend pushes: run by vLLM's venv.

Two things live here:

- ``nccl_gloo``: vLLM 0.32's own dense ``nccl`` weight-transfer engine (both halves:
  `NCCLWeightTransferEngine` in every worker, `NCCLTrainerWeightTransferEngine` on the
  trainer), its communicator swapped for gloo, so that it runs on this CPU-only host. vLLM's
  ``nccl`` backend itself cannot run here, for these reasons (each raised by vLLM 0.32's CPU
  build, `NCCL_UNAVAILABLE`): its group setup asks ``torch.accelerator.current_device_index()``
  ("Cannot access accelerator device when none is available"); its ``PyNcclCommunicator``
  loads libnccl, which vLLM refuses off CUDA/ROCm ("NCCL only supports CUDA and ROCm
  backends"); its packed mode (the trainer's default) runs on ``torch.cuda.Stream``\\ s; its
  one-by-one mode passes ``torch.cuda.current_stream()`` ("Torch not compiled with CUDA
  enabled"); and the base engine's ``update_weights`` ends in
  ``torch.accelerator.synchronize()``. vLLM's own tests of this engine
  (tests/distributed/test_weight_transfer.py) need 2 GPUs and skip on CPU. What is changed,
  and nothing else: the group is torch's ``ProcessGroupGloo`` (trainer rank 0, workers
  1..N, over a TCPStore at vLLM's ``master_address:master_port``) with the communicator's
  ``broadcast``; the one-by-one mode is used (`GlooNCCLTrainerInitInfo.packed` False),
  without the stream argument; ``update_weights`` without the device synchronize. vLLM's
  metadata, its checks of the source against it, its layerwise reload
  (``start_weight_update``/``finish_weight_update``), its ``load_weights`` per tensor and its
  trainer-side driving of the four calls are vLLM's code, run as is.
- the trainer (``python -m tandem.bench.sync_vllm_backend_engine ...``, see `trainer_main`):
  2 FSDP2 ranks pushing through vLLM's trainer API (``WeightTransferTrainerFactory.
  trainer_init(...).send_weights()``) into a ``vllm serve`` with backend ``tandem`` or
  ``nccl_gloo``.

vLLM's workers import this module through ``--worker-extension-cls`` (`NcclOverGloo`, which
adds nothing): importing it registers ``nccl_gloo`` with both of vLLM's factories.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.nccl_common import (
    NCCLWeightTransferInitInfo,
    worker_init_payload,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from tandem.bench.sync_vllm_backend import NCCL_UNAVAILABLE

BACKEND = "nccl_gloo"
TIMEOUT = timedelta(seconds=600)


class GlooBroadcast:
    """What vLLM's engines use of ``PyNcclCommunicator`` (``broadcast``, ``destroy``), over
    torch's gloo; counts the bytes it broadcast (each receiver gets every one)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
        self.group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)
        self.bytes = 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()
        self.bytes += tensor.numel() * tensor.element_size()

    def destroy(self) -> None:
        self.group = None


class GlooNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's dense NCCL worker engine, its group over gloo (see the module's docstring)."""

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        if init_info.packed:
            raise ValueError(f"{BACKEND}: packed mode runs on CUDA streams: {NCCL_UNAVAILABLE}")
        self.packed = False
        parallel = self.parallel_config  # vLLM's rank, as worker_init_process_group has it
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.model_update_group = GlooBroadcast(
            init_info.master_address,
            init_info.master_port,
            rank + init_info.rank_offset,
            init_info.world_size,
        )

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no device synchronize

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """vLLM's one-by-one path, without its CUDA stream argument."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        if self.model_update_group is None:
            raise RuntimeError(f"{BACKEND}: call init_transfer_engine first")
        with disable_mtp_completeness_check():
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            ):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
                self.model_update_group.broadcast(weight, src=0)
                self.model.load_weights([(name, weight)])
                del weight


@dataclass
class GlooNCCLTrainerInitInfo(NCCLTrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    packed: bool = False  # vLLM's default (True) runs on CUDA streams


class GlooNCCLTrainerEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's dense NCCL trainer engine, its group over gloo (see the module's docstring)."""

    init_info_cls = GlooNCCLTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooNCCLTrainerInitInfo, *, client, source=None):
        """vLLM's ``trainer_init``, the trainer's end of the group a `GlooBroadcast`."""
        if source is None:
            raise ValueError(f"{BACKEND}: give source=ModuleSource(model)")
        if init_info.packed:
            raise ValueError(f"{BACKEND}: packed mode runs on CUDA streams: {NCCL_UNAVAILABLE}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        workers = NCCLWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            packed=False,
        )
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, worker_init_payload(workers))
            engine.model_update_group = GlooBroadcast(
                init_info.master_address, init_info.master_port, 0, init_info.world_size
            )
            future.result()
        return engine

    def _broadcast(self, source, meta) -> None:
        """vLLM's one-by-one broadcast, without its CUDA stream argument."""
        if not self.is_sender:
            for _ in source:  # the other ranks join each full_tensor() gather
                pass
            return
        for _name, tensor in self._checked_iter(source, meta):
            send = tensor if tensor.is_contiguous() else tensor.contiguous()
            self.model_update_group.broadcast(send, src=0)


class NcclOverGloo:
    """A worker extension that adds nothing: importing it registers ``nccl_gloo`` in vLLM's
    worker processes (``--worker-extension-cls`` imports it before the engine is made)."""


def register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooNCCLWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooNCCLTrainerEngine)


register()


def trainer_main(
    rank: int, port: str, model_dir: str, url: str, backend: str, group_port: int, pushes: int
) -> None:
    """One of 2 FSDP2 trainer ranks (gloo, one torch thread): ``pushes`` pushes through vLLM's
    trainer API and HTTP client into the ``vllm serve`` at ``url``, backend ``tandem`` or
    ``nccl_gloo`` (its group at ``127.0.0.1:group_port``). Before each push every rank scales
    its shard by the next of `SCALES` (untimed); after each, rank 0 prints ``{"pushed": n,
    "scalings": n}`` and waits for a line ``ok`` (the bench checks vLLM's output). Last line:
    this rank's figures."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from tandem.bench.sync_pushes import SCALES
    from tandem.bench.sync_worker import _fsdp_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = _fsdp_model(model_dir, dist.group.WORLD)
    client = HTTPVLLMWeightSyncClient(url, timeout=600)
    if backend == "tandem":
        from tandem.integrations.vllm import TandemTrainerInitInfo

        info = TandemTrainerInitInfo(rank=rank, world_size=2)
    else:
        workers = int(json.load(_open(url + "/get_world_size"))["world_size"])
        info = GlooNCCLTrainerInitInfo(
            rank=rank, master_address="127.0.0.1", master_port=group_port, world_size=1 + workers
        )
    began = time.perf_counter()
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    init_seconds = time.perf_counter() - began
    seconds, stats = [], None
    for push in range(1, pushes + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(SCALES[(push - 1) % len(SCALES)])
        dist.barrier()
        start = time.perf_counter()
        stats = engine.send_weights()
        seconds.append(time.perf_counter() - start)
        if rank == 0:
            print(json.dumps({"pushed": push, "scalings": push}), flush=True)
            if sys.stdin.readline().strip() != "ok":
                raise RuntimeError("the benchmark did not confirm the push")
        dist.barrier()
    out = {"rank": rank, "seconds": seconds, "init_seconds": init_seconds}
    if backend == "tandem":
        out.update(
            bytes_sent=stats.bytes_sent,
            bytes_needed=stats.bytes_needed,
            bytes_moved=stats.bytes_moved,
            bytes_by_receiver=list(stats.bytes_by_receiver),
            transport=stats.transport,
            version=stats.version,
        )
    elif engine.is_sender:
        out["bytes_broadcast"] = engine.model_update_group.bytes // pushes  # per push
    engine.shutdown()
    dist.barrier()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def _open(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=60)


if __name__ == "__main__":
    r, p, d, u, b, g, n = sys.argv[1:8]
    trainer_main(int(r), p, d, u, b, int(g), int(n))

"""tandem's vLLM worker extension: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` (or
``vllm serve --worker-extension-cls ...``) mixes these methods into every vLLM worker, and
tandem's vLLM target calls them through vLLM's ``collective_rpc``. Arguments and answers are
tandem's typed messages as bytes (`tandem.integrations.vllm.messages`)."""

from __future__ import annotations

import os

from tandem.dtypes import DTYPES
from tandem.integrations.vllm.layouts import Shapes, Split, worker_layout
from tandem.integrations.vllm.messages import (
    VLLM,
    PhaseRequest,
    SendWeights,
    WeightsSent,
    WorkerInfo,
)
from tandem.integrations.vllm.receiver import VllmReceiver

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TandemWorkerExtension:
    """Methods vLLM adds to its worker class (names start with ``tandem_`` so none shadows a
    worker's own)."""

    def tandem_worker_info(self) -> bytes:
        """This worker as a receiving rank (`WorkerInfo`)."""
        receiver = self._tandem_receiver()
        model = self.model_runner.get_model()
        return VLLM.encode(WorkerInfo(os.getpid(), type(model).__name__, receiver.layout))

    def tandem_push_phase(self, request: bytes) -> bytes:
        """One phase of a push on this worker (`PhaseRequest` -> `PhaseReply`)."""
        req = VLLM.decode(request)
        if not isinstance(req, PhaseRequest):
            raise ValueError(f"expected a PhaseRequest, got {type(req).__name__}")
        receiver = self._tandem_receiver()
        records = req.records[self.rank] if self.rank < len(req.records) else []
        return VLLM.encode(receiver.run(req.phase, req.spec, records))

    def tandem_send_weights(self, request: bytes) -> bytes:
        """This worker as a trainer rank: its weights into another replica (`SendWeights` ->
        `WeightsSent`), read back from vLLM's layers and pushed like any trainer's
        (`tandem.fleet.peer.RankSender`): planned, moved and CRC-checked where they land."""
        from tandem.fleet.peer import RankSender

        req = VLLM.decode(request)
        if not isinstance(req, SendWeights):
            raise ValueError(f"expected SendWeights, got {type(req).__name__}")
        receiver = self._tandem_receiver()
        try:
            sender = RankSender(
                receiver.layout,
                receiver.read_weights(),
                req.workers,
                req.url,
                req.timeout_s,
                req.transport,
                req.admin_key,
                None,  # vLLM's weights carry no push id (`VllmTarget.weight_base`)
                mode="staged",  # what a vLLM server takes; a tandem serve takes it too
            )
            try:
                stats = sender.push(req.version, rollback=True, delta=False)
            finally:
                sender.close()
        except Exception as exc:
            return VLLM.encode(WeightsSent(f"{type(exc).__name__}: {exc}", req.version, 0, 0.0))
        return VLLM.encode(WeightsSent(None, stats.version, stats.bytes_moved, stats.seconds))

    def _tandem_receiver(self) -> VllmReceiver:
        receiver = getattr(self, "_tandem_state", None)
        if receiver is None:
            model = self.model_runner.get_model()
            receiver = worker_receiver(model, self.vllm_config, self.device, self.rank)
            self._tandem_state = receiver
        return receiver


def worker_receiver(model, vllm_config, device, rank: int) -> VllmReceiver:
    """The receiving side of vLLM worker ``rank`` (its boxes declared by the layout table of
    its model class), for the worker extension and the ``tandem`` weight-transfer backend."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("tandem pushes into vLLM with pipeline_parallel_size=1 only")
    if vllm_config.parallel_config.enable_expert_parallel:
        raise ValueError("tandem pushes into vLLM without expert parallelism only")
    dtype = vllm_config.model_config.dtype
    if dtype not in _NAMES:
        raise ValueError(f"vLLM holds weights in {dtype}; tandem sends {sorted(DTYPES)}")
    tp = Split(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
    names = [n for n, _ in model.named_parameters()]
    shapes = Shapes.of(vllm_config.model_config.hf_text_config)
    layout = worker_layout(type(model).__name__, names, shapes, tp, rank, _NAMES[dtype])
    return VllmReceiver(model, layout, vllm_config, device)

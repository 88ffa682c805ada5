"""The inference side of vLLM's ``tandem`` weight-transfer backend: ``vllm serve MODEL
--weight-transfer-config '{"backend": "tandem"}'`` (or ``vllm.LLM(...,
weight_transfer_config={"backend": "tandem"})``) makes one `TandemWeightTransferEngine` per
vLLM worker once tandem is installed (`tandem.integrations.vllm.plugin` registers it).

vLLM's four-call protocol carries tandem's push, driven by the trainer's rank 0
(`tandem.integrations.vllm.trainer`):

- ``init_weight_transfer_engine({"trainer": "host:port/token"})``: each worker reports what it
  holds (its `RankLayout`) and what it serves to the trainer (`BackendHello`), which plans.
- ``start_weight_update()``: opens the update.
- ``update_weights([{"phase_request": ...}, ...])``: one entry per worker (vLLM's list payload),
  one call per phase (receive, verify, commit), each worker only its own boxes
  (`VllmReceiver`: staged, CRC32-checked against the trainer's, committed into vLLM's layers
  and read back through its kernels).
- ``finish_weight_update(weight_version)``: closes it; a push left open (its trainer died or
  failed) is dropped there, the old weights serving.

Versions only go forward, as in tandem's own engine: before any byte of a push reaches a
worker, one ``update_weights`` call asks every worker whether the push's version is above the
one it serves (`VersionCheck`); they refuse one that is not, unless the trainer asked for it
with ``send_weights(version, rollback=True)``, and the trainer raises
`tandem.errors.StaleVersionError` naming both, the served weights untouched.

vLLM's protocol answers nothing but errors, so the workers agree on each phase's outcome and
fail together (a worker that passed drops its part when another failed); vLLM's last worker
raises their errors (`TandemWeightTransferEngine._answer` says why only it), saying whether
vLLM's weights are torn (a commit that failed after loading began) or the old version keeps
serving.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from tandem.exchange.address import ExchangeAddress
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.integrations.vllm.messages import (
    STALE_VERSION,
    TORN_COMMIT,
    VLLM,
    BackendHello,
    PhaseReply,
    PhaseRequest,
    VersionCheck,
    WorkerInfo,
)
from tandem.integrations.vllm.receiver import VllmReceiver
from tandem.integrations.vllm.worker import worker_receiver
from tandem.wire import send_frame, send_token

log = logging.getLogger(__name__)

MAX_ERROR_BYTES = 4096  # of one worker's error, as the workers share them
REPORT_TIMEOUT_S = 60.0


@dataclass
class TandemInitInfo(WeightTransferInitInfo):
    trainer: str  # host:port/token where the trainer's rank 0 takes the workers' reports


@dataclass
class TandemUpdateInfo(WeightTransferUpdateInfo):
    phase_request: str  # base64 of a `PhaseRequest` holding this worker's records alone, or a
    # `VersionCheck`


def encode_update(request: PhaseRequest | VersionCheck) -> dict:
    """One worker's entry of an ``update_weights`` list payload (JSON-safe)."""
    return {"phase_request": base64.b64encode(VLLM.encode(request)).decode("ascii")}


class TandemPushError(RuntimeError):
    """A call failed on some worker (raised by vLLM's last worker alone: see `_answer`)."""


class TandemWeightTransferEngine(WeightTransferEngine[TandemInitInfo, TandemUpdateInfo]):
    """One vLLM worker's receiving side of tandem's pushes."""

    init_info_cls = TandemInitInfo
    update_info_cls = TandemUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        parallel = vllm_config.parallel_config
        self.rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.workers = parallel.data_parallel_size * parallel.world_size
        self.last = parallel.rank == parallel.world_size - 1  # raises the workers' errors
        self.version = 0  # the last tandem version committed here (0: loaded from disk)
        self.torn: str | None = None
        self.in_update = False  # vLLM's worker holds an update open (as vLLM tracks it)
        self._receiver: VllmReceiver | None = None
        self._open: UpdateSpec | None = None  # a push received or verified, not committed

    def init_transfer_engine(self, init_info: TandemInitInfo) -> None:
        """Report to the trainer at ``init_info.trainer`` (a trainer connecting anew drops
        whatever an earlier one left open; it finishes vLLM's update if one is open)."""
        self._drop_open("a new trainer connected")
        error = None
        try:
            receiver = self._receiving_side()
            address = ExchangeAddress.parse(init_info.trainer)
            info = WorkerInfo(os.getpid(), type(self.model).__name__, receiver.layout)
            hello = BackendHello(
                self.rank, self.workers, info, self.version, self.torn, self.in_update
            )
            with socket.create_connection((address.host, address.port), REPORT_TIMEOUT_S) as sock:
                send_token(sock, address.token)
                send_frame(sock, VLLM.encode(hello))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors, _, _ = _together(PhaseReply(error, 0), self.parallel_config.world_size)
        if errors:
            self._answer(f"tandem: init_weight_transfer_engine failed: {_said(errors)}")

    def start_weight_update(self) -> None:
        self.in_update = True
        if self._receiver is None:
            self._answer("tandem: call init_weight_transfer_engine first")

    def update_weights(self, update_info: dict) -> None:
        """vLLM's default ends in ``torch.accelerator.synchronize()``, which raises on its CPU
        build; tandem's receiving side has finished with every byte when it returns."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TandemUpdateInfo) -> None:
        request = VLLM.decode(base64.b64decode(update_info.phase_request))
        if isinstance(request, VersionCheck):
            self._check_version(request)
            return
        if not isinstance(request, PhaseRequest) or len(request.records) != 1:
            raise ValueError("tandem: update_info holds no PhaseRequest for one worker")
        phase, spec = request.phase, request.spec
        if self._receiver is None:
            reply = PhaseReply("call init_weight_transfer_engine first", 0)
        else:
            reply = self._receiver.run(phase, spec, request.records[0])
        errors, torn, workers = _together(reply, self.parallel_config.world_size)
        if not errors:
            self._passed(phase, spec)
            return
        if reply.error is None and phase is not PushPhase.ABORT:
            self._receiver.run(PushPhase.ABORT, spec, [])  # another worker failed it
        self._open = None
        if phase is PushPhase.COMMIT and (torn or len(errors) < workers):
            # some worker began loading (or finished): the workers' weights disagree now
            self.torn = f"the commit of version {spec.version} failed: {_said(errors)}"
            self._answer(
                f"{TORN_COMMIT} (torn): the commit of version {spec.version} failed "
                f"after loading began, and vLLM keeps serving them until a push "
                f"lands: {_said(errors)}"
            )
            return
        self._answer(
            f"tandem: version {spec.version} rejected in {phase.value}; {self._serving()} "
            f"keeps serving: {_said(errors)}"
        )

    def _check_version(self, check: VersionCheck) -> None:
        """Refuse, on every worker alike, a version not above the one this worker serves
        (unless ``check.rollback``): before any byte of the push moves."""
        error = None
        if self._receiver is None:
            error = "call init_weight_transfer_engine first"
        elif check.version <= self.version and not check.rollback:
            error = f"{STALE_VERSION} {check.version}: this worker serves version {self.version}"
        errors, _, _ = _together(PhaseReply(error, 0), self.parallel_config.world_size)
        if errors:
            self._answer(
                f"tandem: version {check.version} refused before any byte moved; "
                f"{self._serving()} keeps serving: {_said(errors)}"
            )

    def _serving(self) -> str:
        return f"torn weights ({self.torn})" if self.torn else f"version {self.version}"

    def finish_weight_update(self) -> None:
        self.in_update = False
        self._drop_open("finished without a commit (its trainer failed or left)")

    def shutdown(self) -> None:
        self._drop_open("the weight-transfer engine shut down")

    def _answer(self, error: str | None) -> None:
        """Report the workers' common ``error`` through vLLM's answer: only vLLM's last worker
        raises it. vLLM's multiprocess executor (0.32) stops reading the workers' answers at
        the first failure it reads, in worker order, and leaves the others queued, to be read
        as the answers of later calls: every later call would get its predecessor's answer
        from those workers. vLLM ends the update of a worker that raises; the others keep it
        open, and the trainer finishes it (`ClientTarget`)."""
        if not error:
            return
        if self.last:
            self.in_update = False
            raise TandemPushError(error)
        log.warning("%s", error)

    def _passed(self, phase: PushPhase, spec: UpdateSpec) -> None:
        if phase is PushPhase.COMMIT:
            self._open, self.version, self.torn = None, spec.version, None
        elif phase is PushPhase.ABORT:
            self._open = None
        else:
            self._open = spec

    def _drop_open(self, why: str) -> None:
        if self._open is not None and self._receiver is not None:
            log.warning("tandem: dropping the push of version %d: %s", self._open.version, why)
            self._receiver.run(PushPhase.ABORT, self._open, [])
        self._open = None

    def _receiving_side(self) -> VllmReceiver:
        if self._receiver is None:
            self._receiver = worker_receiver(self.model, self.vllm_config, self.device, self.rank)
        return self._receiver


def _said(errors: list[tuple[int, str]]) -> str:
    return "; ".join(f"worker {rank}: {error}" for rank, error in errors)


def _together(reply: PhaseReply, world_size: int) -> tuple[list[tuple[int, str]], bool, int]:
    """Every worker's outcome of a phase, gathered over vLLM's world group (its CPU, gloo,
    group): (the errors by worker, whether any worker's commit tore its weights, how many
    workers)."""
    from vllm.distributed.parallel_state import get_world_group

    mine = _error_row(reply)
    if world_size == 1:  # (an offline engine's one worker may run without vLLM's group)
        rows = [mine]
    else:
        group = get_world_group()
        rows = [torch.empty_like(mine) for _ in range(group.world_size)]
        torch.distributed.all_gather(rows, mine, group=group.cpu_group)
    errors, torn = [], False
    for rank, row in enumerate(rows):
        length = int(row[1]) | int(row[2]) << 8
        if length:
            errors.append((rank, bytes(row[3 : 3 + length].tolist()).decode(errors="replace")))
        torn |= bool(row[0])
    return errors, torn, len(rows)


def _error_row(reply: PhaseReply) -> torch.Tensor:
    """(torn, length low byte, length high byte, the error's UTF-8 bytes) as one uint8 row."""
    data = (reply.error or "").encode()[:MAX_ERROR_BYTES]
    if reply.error is not None and not data:
        data = b"failed"
    row = torch.zeros(3 + MAX_ERROR_BYTES, dtype=torch.uint8)
    row[0], row[1], row[2] = int(reply.torn), len(data) & 0xFF, len(data) >> 8
    row[3 : 3 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return row

"""vLLM's RL weight transfer on this server's target: the state behind
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` and
``/finish_weight_update`` (`tandem.server.weight_transfer_routes`).

- init: the trainer's group forms (every receiving rank joins it, in a window of its own:
  `tandem.exchange.transports.broadcast`); it lasts until the next init or a broken broadcast;
- start: a push window opens on the target (`WindowHost`): no step runs until it closes
  (tandem's senders name the version there, so a stale one is refused before any byte moves);
- update (any number of calls): the call's tensors are planned onto the ranks' pieces (a
  record per piece of a named tensor), then every rank takes part in each broadcast and lands
  its records, staged beside the live weights (``mode="staged"``, the default) or in them
  (``in_place``); a call naming a tensor the engine does not hold, or with the wrong shape, is
  received and dropped (the trainer is not left hanging) and fails the transfer;
- finish: every record of the transfer is checked and committed, and the version published
  (the one given, else the served one + 1); only then.

Versions only go forward, as with every push: a version not greater than the served one (a
fleet: the newest any replica holds) is refused (409, naming both) unless the call says
``rollback``; refused at start, nothing moves; refused at finish (vLLM's clients name it only
there), the transfer is dropped: staged, the served weights stay untouched.

A failed or abandoned transfer (an error, ``start`` never finished within the idle timeout)
closes the window as failed: staged, the old version keeps serving; in place, the engine
refuses requests until a complete push lands, as every tandem push.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace

from tandem.dtypes import DTYPES
from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import (
    BroadcastCall,
    BroadcastTensor,
    PushPhase,
    PushSettings,
    UpdateSpec,
)
from tandem.exchange.transports.broadcast import group_info
from tandem.layers.fp8 import scale_name
from tandem.server.remote_window import WindowHost


class TransferError(Exception):
    """A call the protocol's state refuses (``status`` 409) or whose input is wrong (400)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class TransferInit:
    """`init_info` as tandem takes it (vLLM's `NCCLWeightTransferInitInfo`, and ``mode``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed_bytes: int  # 0: one broadcast per tensor
    mode: str = "staged"


def plan_call(
    layouts: list[RankLayout], tensors: list[BroadcastTensor]
) -> tuple[dict[int, list[Record]], list[str]]:
    """Per receiving rank, a record for each piece of its parameters that a tensor of the call
    fills (``offset``: the tensor's index in the call); and every problem with the call's
    names, dtypes and shapes."""
    shapes: dict[str, tuple[int, ...]] = {}
    fp8: set[str] = set()
    for layout in layouts:
        shapes.update(layout.canonical_shapes())
        fp8.update(layout.fp8_blocks)
    problems, index = [], {}
    for i, t in enumerate(tensors):
        if t.name in index:
            problems.append(f"{t.name} is listed twice")
        elif t.name not in shapes:
            problems.append(f"{t.name}: the engine holds no such tensor")
        elif tuple(t.shape) != shapes[t.name]:
            problems.append(
                f"{t.name}: shape {list(t.shape)} sent, the engine's is {list(shapes[t.name])}"
            )
        elif t.name in fp8 and t.dtype != "float8_e4m3fn":
            problems.append(
                f"{t.name}: the engine holds it as block-FP8: send its e4m3 values "
                f"and {scale_name(t.name)} (or push with tandem's WeightSender, "
                f"which quantizes)"
            )
        index.setdefault(t.name, i)
    records: dict[int, list[Record]] = {}
    for layout in layouts:
        for region in layout.regions:
            i = index.get(region.piece.name)
            if i is None:
                continue
            piece, dtype = region.piece, layout.dtype_of(region.key)
            nbytes = math.prod(piece.box_shape) * DTYPES[dtype].itemsize
            records.setdefault(layout.rank, []).append(
                Record(0, i, nbytes, region.key, piece.region(), piece.box_shape, dtype)
            )
    return records, problems


class WeightTransfer:
    """One server's side of the protocol (calls are serialized): its ``fleet``'s target."""

    def __init__(self, fleet, windows: WindowHost, timeout_s: float):
        self.fleet = fleet
        self.target = fleet.target
        self.windows = windows
        self.timeout_s = timeout_s
        self.init_info: TransferInit | None = None
        self._token: str | None = None  # the open transfer's window
        self._spec: UpdateSpec | None = None
        self._records: dict[int, dict[tuple, Record]] = {}
        self._tensors: set[str] = set()
        self._started = 0.0
        self._rollback = False  # the open transfer's start said rollback
        self._lock = threading.Lock()

    def world_size(self) -> int:
        """The receiving ranks (vLLM: TP x PP x DP; here every rank of every replica)."""
        return len(self.target.weight_layouts())

    def init(self, info: TransferInit) -> None:
        """Join the trainer's group on every receiving rank (blocks until it forms)."""
        with self._lock:
            if self._busy():
                raise TransferError(409, "a weight update is open: finish it first")
            ranks = self.world_size()
            if info.world_size != info.rank_offset + ranks:
                raise TransferError(
                    400,
                    f"world_size must be rank_offset + {ranks} (this "
                    f"server's receiving ranks), got {info.world_size}",
                    "init_info.world_size",
                )
            spec = self._spec_for(info, self.target.weight_version, [], join=True)
            token = self.windows.open(spec)
            try:
                self.windows.run(token, lambda u: u.run(PushPhase.RECEIVE, {}))
            except Exception as exc:
                raise TransferError(502, f"the trainer's group did not form: {exc}") from None
            finally:
                self.windows.close(token, ok=True)  # nothing landed: nothing changes
            self.init_info = info

    def shutdown(self) -> None:
        with self._lock:
            self._abandon()
            self.init_info = None

    def start(self, version: int | None = None, rollback: bool = False) -> int:
        """Open the transfer's window; the version it will publish unless finish names one
        (``version``, checked now: see `forward`; else the served one + 1)."""
        with self._lock:
            if self.init_info is None:
                raise TransferError(409, "call /init_weight_transfer_engine first")
            if self._busy():
                raise TransferError(409, "a weight update is already open")
            served = self.target.weight_version
            if version is None:
                version = served + 1
            self.forward(version, rollback, served)
            self._rollback = rollback
            spec = self._spec_for(self.init_info, version, [])
            self._token = self.windows.open(spec)
            self._spec, self._records, self._tensors = spec, {}, set()
            self._started = time.perf_counter()
            if spec.settings.in_place:
                self.windows.run(self._token, lambda u: u.expose())
            return spec.version

    def update(self, tensors: list[BroadcastTensor]) -> dict:
        """Receive one call's broadcasts on every rank."""
        with self._lock:
            token = self._open_token()
            records, problems = plan_call(self.target.weight_layouts(), tensors)
            if problems:  # receive and drop the bytes, then fail: the trainer is not left hanging
                records = {}
            spec = self._spec_for(self.init_info, self._spec.version, tensors)

            def receive(update):
                update.spec = spec
                return update.run(PushPhase.RECEIVE, records)

            try:
                received = self.windows.run(token, receive)
            except Exception as exc:
                self._abandon()
                self._tell(spec.version, str(exc))
                raise TransferError(502, f"the update failed; {exc}") from None
            if problems:
                self._abandon()
                self._tell(spec.version, "; ".join(problems))
                after = (
                    "the engine refuses requests until a complete transfer lands"
                    if spec.settings.in_place
                    else "the served version stays"
                )
                raise TransferError(
                    400,
                    f"{len(problems)} problem(s), the transfer is "
                    f"dropped and {after}: {'; '.join(problems[:10])}",
                    "update_info",
                )
            for rank, mine in records.items():
                held = self._records.setdefault(rank, {})
                held.update({(r.key, r.region): r for r in mine})
            self._tensors.update(t.name for t in tensors)
            return {"tensors": len(tensors), "bytes_received": received}  # by all ranks

    def finish(self, version: int | None, rollback: bool = False) -> dict:
        """Check and commit everything the transfer landed; publish ``version`` (a stale one,
        see `forward`, drops the transfer)."""
        with self._lock:
            token = self._open_token()
            spec = self._spec
            if version is not None:
                try:
                    self.forward(version, rollback or self._rollback)
                except TransferError as exc:
                    self._abandon()
                    self._tell(version, str(exc))
                    raise
                spec = replace(spec, version=version)
            records = {rank: list(held.values()) for rank, held in self._records.items()}

            def commit(update):
                update.spec = spec
                update.run(PushPhase.VERIFY, records)
                return update.run(PushPhase.COMMIT, records)

            try:
                nbytes = self.windows.run(token, commit)
                self.windows.close(token, ok=True)
            except Exception as exc:
                self._abandon()
                self._tell(spec.version, str(exc))
                raise TransferError(502, f"the update failed; {exc}") from None
            finally:
                self._token = None
            seconds = self._tell(spec.version, None)
            return {
                "weight_version": spec.version,
                "tensors": len(self._tensors),
                "bytes_committed": nbytes,
                "seconds": round(seconds, 4),
            }

    def relabel(self, version: int, rollback: bool = False) -> None:
        """Name the served weights ``version`` (vLLM's ``/update_weight_version``): the
        served one again, a greater one, or a smaller one with ``rollback``."""
        with self._lock:
            if self._busy():
                raise TransferError(409, "a weight update is open: finish it first")
            if version != self.target.weight_version:
                self.forward(version, rollback, param="new_version")
            for engine in self.fleet.engines:
                engine.window.relabel(version)

    def forward(
        self, version: int, rollback: bool, served: int | None = None, param: str = "weight_version"
    ) -> None:
        """Refuse (409, naming ``param``) a version not greater than the served one, unless
        it is a rollback."""
        served = self.target.weight_version if served is None else served
        if version <= served and not rollback:
            raise TransferError(
                409,
                f"{param} {version} is not greater than version {served} "
                f"the engine serves: versions only go forward; send a greater "
                f"one, or rollback: true to roll back on purpose",
                param,
                "stale_version",
            )

    def _tell(self, version: int, error: str | None) -> float:
        seconds = time.perf_counter() - self._started
        for listener in self.target.update_listeners:
            listener(version, seconds, error)
        return seconds

    def _busy(self) -> bool:
        """A transfer is open (one whose window closed on its own, idle, is over)."""
        return self._token is not None and self.windows.is_open(self._token)

    def _open_token(self) -> str:
        if self._token is None:
            raise TransferError(409, "call /start_weight_update first")
        return self._token

    def _abandon(self) -> None:
        """Close the open window as failed (every rank drops what the transfer held)."""
        token, self._token = self._token, None
        if token is None:
            return
        try:
            self.windows.close(token, ok=False)
        except Exception:  # closed already (timed out): it dropped what it held then
            pass

    def _spec_for(
        self, info: TransferInit, version: int, tensors: list[BroadcastTensor], join: bool = False
    ) -> UpdateSpec:
        group = group_info(info.master_address, info.master_port, info.world_size, self.timeout_s)
        # verify=False: the records carry no sender CRC32s; the receivers check what arrived
        # against the CRC32s tandem's senders give, and read every landed box back
        return UpdateSpec(
            version,
            PushSettings("broadcast", info.mode, verify=False),
            self.target.weight_dtype,
            info.rank_offset,
            broadcast=BroadcastCall(tuple(tensors), info.packed_bytes, join),
            group=group,
        )

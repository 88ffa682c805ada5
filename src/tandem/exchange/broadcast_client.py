"""The trainer's end of vLLM's RL weight-transfer protocol, as tandem's own client speaks it to a
`tandem serve` (`tandem.server.weight_transfer`): rank 0 of a group of itself and every
receiving rank, broadcasting named full tensors.

    client = BroadcastClient("http://127.0.0.1:8000", admin_key="...")
    client.push(model.named_parameters(), version=step)  # or any (name, tensor) stream

Tensors are taken from the stream a bucket at a time (``bucket_bytes``, vLLM's packing rule),
so no more than one bucket is ever held beside the trainer's own tensors; each bucket is one
``/update_weights`` call whose broadcast runs while the call waits. Every tensor's CRC32 goes
with its metadata, so every engine rank checks what arrived. Where the trainer can run
`WeightSender` instead (its layout known), each engine rank receives only its own slices: a
broadcast gives every rank every byte.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import crc32
from tandem.exchange.settings import BroadcastTensor
from tandem.exchange.transports.broadcast import broadcast, gloo_group
from tandem.wire import free_port

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TransferFailed(RuntimeError):
    """The server refused a call or a broadcast broke; says what the server answered."""


class BroadcastClient:
    """``url``: a `tandem serve` started with ``--admin-key``; ``host``: this process's address
    as the engine's ranks reach it (they connect to the group's store here); ``mode``: the
    server's ``staged`` (default) or ``in_place``."""

    def __init__(
        self,
        url: str,
        admin_key: str | None = None,
        *,
        host: str = "127.0.0.1",
        bucket_bytes: int = 64 << 20,
        mode: str = "staged",
        timeout_s: float = 300.0,
    ):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.host = host
        self.bucket_bytes = bucket_bytes
        self.mode = mode
        self.timeout_s = timeout_s
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None
        self.bytes_sent = 0

    def connect(self) -> None:
        """Form the group with the server's ranks (``/init_weight_transfer_engine``)."""
        if self._group is not None:
            return
        world = self._get("/get_world_size")["world_size"] + 1
        port = free_port(self.host)
        info = {
            "master_address": self.host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_bytes,
            "mode": self.mode,
        }
        forming = _Background("group", self._form, port, world)
        # answers once every engine rank joined (or failed to): a refusal ends the wait now,
        # leaving the group's thread to time out
        self._post("/init_weight_transfer_engine", {"init_info": info})
        try:
            self._store, self._group = forming.result()
        except BaseException as exc:
            raise TransferFailed(f"the group did not form: {exc}") from None

    def _form(self, port: int, world: int) -> tuple:
        """Host the group's store and form its rank 0."""
        store = dist.TCPStore(
            self.host,
            port,
            world,
            is_master=True,
            timeout=timedelta(seconds=self.timeout_s),
            use_libuv=False,
        )
        return store, gloo_group(store, 0, world, self.timeout_s)

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        *,
        rollback: bool = False,
    ) -> dict:
        """One transfer: start, a call per bucket, finish (publishing ``version``, else the
        served one + 1). The server's answer to finish. A ``version`` not greater than the
        served one is refused at start (`TransferFailed`, HTTP 409), before any byte moves,
        unless ``rollback``."""
        self.start(version, rollback=rollback)
        try:
            bucket = Bucket(self.bucket_bytes)
            for name, tensor in named_tensors:
                if bucket.add(name, tensor):
                    self.send(bucket.take())
            if bucket.tensors:
                self.send(bucket.take())
        except BaseException:
            self.close()  # the server cannot tell a dead trainer from a slow one: leave
            raise
        return self.finish(version, rollback=rollback)

    def start(self, version: int | None = None, *, rollback: bool = False) -> None:
        """Open a transfer (joins the group first if need be), to publish ``version``."""
        self.connect()
        self._post("/start_weight_update", _version_body(version, rollback))

    def finish(self, version: int | None = None, *, rollback: bool = False) -> dict:
        """Commit the transfer; the server's answer (the version it published, ...)."""
        return self._post("/finish_weight_update", _version_body(version, rollback))

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One ``/update_weights`` call and its broadcast: ``bucket``'s tensors, in order."""
        raw = [t.reshape(-1).view(torch.uint8) for _, t in bucket]
        metas = [
            BroadcastTensor(name, _NAMES[t.dtype], tuple(t.shape), crc32(r))
            for (name, t), r in zip(bucket, raw, strict=True)
        ]
        info = {
            "names": [m.name for m in metas],
            "dtype_names": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas],
            "crc32s": [m.crc for m in metas],
        }
        call = _Background("update", self._post_or_leave, "/update_weights", {"update_info": info})
        try:
            buf = torch.cat(raw) if len(raw) > 1 else raw[0]
            broadcast(self._group, buf)
            self.bytes_sent += buf.numel()
        finally:
            call.result()

    def _post_or_leave(self, path: str, body: dict) -> dict:
        try:
            return self._post(path, body)
        except BaseException:  # refused: free the broadcast waiting on it
            self.close()
            raise

    def close(self) -> None:
        """Leave the group (the server's ranks leave it at their next init or failure)."""
        if self._group is not None:
            try:
                self._group.abort()
            except Exception:
                pass
        self._group, self._store = None, None

    def _get(self, path: str) -> dict:
        return self._request(urllib.request.Request(self.url + path, headers=self._headers()))

    def _post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = self._headers() | {"Content-Type": "application/json"}
        return self._request(urllib.request.Request(self.url + path, data, headers))

    def _headers(self) -> dict:
        return {} if self.admin_key is None else {"Authorization": f"Bearer {self.admin_key}"}

    def _request(self, request: urllib.request.Request) -> dict:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise TransferFailed(f"{request.full_url}: {exc.code} {exc.read().decode()}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise TransferFailed(f"{request.full_url}: {exc}") from None


def _version_body(version: int | None, rollback: bool) -> dict:
    body = {} if version is None else {"weight_version": str(version)}
    return body | ({"rollback": True} if rollback else {})


class Bucket:
    """Tensors taken from a stream until they pass ``limit`` bytes (vLLM's rule: the tensor
    that crosses it goes too), detached, on the CPU, contiguous."""

    def __init__(self, limit: int):
        self.limit = limit
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Take one tensor; whether the bucket is full."""
        if tensor.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} is not one of {sorted(DTYPES)}")
        self.tensors.append((name, tensor.detach().to("cpu").contiguous()))
        self.nbytes += tensor.numel() * tensor.element_size()
        return self.nbytes > self.limit

    def take(self) -> list[tuple[str, torch.Tensor]]:
        out, self.tensors, self.nbytes = self.tensors, [], 0
        return out


class _Background(threading.Thread):
    """``call(*args)`` on a thread of its own (what waits on this process's broadcasts)."""

    def __init__(self, what: str, call, *args):
        super().__init__(name=f"tandem-transfer-{what}", daemon=True)
        self.call, self.args = call, args
        self.answer = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.answer = self.call(*self.args)
        except BaseException as exc:
            self.error = exc

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.answer

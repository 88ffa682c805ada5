"""Transports carry out plans; they never decide what goes where (`base` for the interface).
`TRANSPORTS` is the registry: a new transport is one module with a sender and a receiver half,
and one entry here."""

from tandem.exchange.transports.base import Transport
from tandem.exchange.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from tandem.exchange.transports.dist import DistReceiver, DistSender
from tandem.exchange.transports.shm import ShmReceiver, ShmSender

TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport("shm", ("staged", "in_place"), ShmSender, ShmReceiver),
        Transport("dist", ("staged", "in_place"), DistSender, DistReceiver, engine_receives=True),
        Transport("cuda_ipc", ("staged",), CudaIpcSender, CudaIpcReceiver),
    )
}

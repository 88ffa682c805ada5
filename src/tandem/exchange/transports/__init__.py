"""Transports carry out plans; they never decide what goes where (`base` for the interface).
`TRANSPORTS` is the registry: a new transport is one module with a sender and a receiver half
and its `Transport` entry, and one line here. Admin routes and settings read it."""

from tandem.exchange.transports.base import Transport
from tandem.exchange.transports.cuda_ipc import CudaIpcTransport
from tandem.exchange.transports.dist import DistTransport
from tandem.exchange.transports.shm import ShmTransport

TRANSPORTS: dict[str, Transport] = {
    t.name: t for t in (ShmTransport(), DistTransport(), CudaIpcTransport())
}

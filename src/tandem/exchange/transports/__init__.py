"""Transports carry out plans; they never decide what goes where (`base` for the interface).
`TRANSPORTS` is the registry: a new transport is one module with a sender and a receiver half
and its `Transport` entry, and one line here. Admin routes, the sender and the exchange server
read it; `check` holds a push's settings to it."""

from tandem.exchange.settings import PushSettings
from tandem.exchange.transports.base import Transport
from tandem.exchange.transports.broadcast import BroadcastTransport
from tandem.exchange.transports.cuda_ipc import CudaIpcTransport
from tandem.exchange.transports.dist import DistTransport
from tandem.exchange.transports.mooncake import MooncakeTransport
from tandem.exchange.transports.shm import ShmTransport

TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        ShmTransport(),
        DistTransport(),
        CudaIpcTransport(),
        MooncakeTransport(),
        BroadcastTransport(),
    )
}


def check(settings: PushSettings) -> PushSettings:
    """``settings`` if its transport is registered and takes its mode; else ValueError naming
    the field."""
    transport = TRANSPORTS.get(settings.transport)
    if transport is None or transport.sender is None:
        raise ValueError(f"transport must be one of {pushed()}, got {settings.transport!r}")
    if settings.mode not in transport.modes:
        raise ValueError(
            f"mode must be one of {transport.modes} for transport {settings.transport!r}, "
            f"got {settings.mode!r}"
        )
    return settings


def pushed() -> list[str]:
    """The transports a `WeightSender` pushes over (``broadcast`` is vLLM's protocol's)."""
    return sorted(name for name, t in TRANSPORTS.items() if t.sender is not None)

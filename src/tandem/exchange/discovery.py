"""Where to push: an engine's exchange address, given directly or asked of a `tandem serve`.

A `WeightSender` target may be ``host:port/token`` (an `LLM`'s ``exchange_address``) or a
server's address (``http://host:port`` or ``host:port``): then ``GET /admin/weights`` with the
admin key returns the exchange endpoint. HTTP only negotiates; the tensor bytes go through
the transports. Any object with an ``exchange_address`` is a target too, and so is another
project's engine an integration adapts: adapters are found through the ``tandem.targets``
entry point group (tandem's own: vLLM engines, `tandem.integrations.vllm.exchange_address_of`),
loaded the first time a target is not one of the above, or given to `register_target_adapter`.
The exchange imports no integration itself.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib.metadata import entry_points
from urllib.parse import urlsplit

from tandem.exchange.address import ExchangeAddress

ADMIN_KEY_ENV = "TANDEM_ADMIN_KEY"
TARGETS_GROUP = "tandem.targets"  # entry points: adapters of other projects' engines

log = logging.getLogger(__name__)

# an engine object of another project -> its exchange address, or None when not its kind
TargetAdapter = Callable[[object], str | None]
_TARGET_ADAPTERS: list[TargetAdapter] = []
_entry_points_loaded = False


def register_target_adapter(adapter: TargetAdapter) -> None:
    """Let `WeightSender` take engines ``adapter`` recognises (it opens their exchange)."""
    if adapter not in _TARGET_ADAPTERS:
        _TARGET_ADAPTERS.append(adapter)


def target_address(target, admin_key: str | None = None) -> ExchangeAddress:
    """Where a push to ``target`` goes: a string as `exchange_address` reads it; an object's
    ``exchange_address``; else what a registered adapter makes of it."""
    if isinstance(target, str):
        return exchange_address(target, admin_key)
    if hasattr(target, "exchange_address"):
        return ExchangeAddress.parse(target.exchange_address)
    for adapter in _adapters():
        address = adapter(target)
        if address is not None:
            return ExchangeAddress.parse(address)
    raise TypeError(
        f"cannot push into a {type(target).__name__}: give an LLM, its "
        f"exchange_address, a server's URL, or an engine an integration adapts "
        f"(a vLLM LLM made with tandem's worker extension)"
    )


def _adapters() -> list[TargetAdapter]:
    """The registered adapters, with those the installed packages declare (loaded once)."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for point in entry_points(group=TARGETS_GROUP):
            try:
                register_target_adapter(point.load())
            except Exception as exc:  # a broken plugin must not break every other push
                log.warning(
                    "target adapter %s (%s) could not be loaded: %s", point.name, point.value, exc
                )
    return list(_TARGET_ADAPTERS)


class DiscoveryError(RuntimeError):
    """The server could not be asked for its exchange endpoint (names the URL and why)."""


def exchange_address(
    target: str, admin_key: str | None = None, timeout_s: float = 30.0
) -> ExchangeAddress:
    """``target`` parsed as ``host:port/token``, or the exchange endpoint of the `tandem serve`
    at ``target``."""
    if "/" in target and not target.startswith(("http://", "https://")):
        return ExchangeAddress.parse(target)
    if not target.startswith(("http://", "https://")):
        target = "http://" + target  # host:port of a server
    url = target.rstrip("/") + "/admin/weights"
    key = admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not key:
        raise DiscoveryError(
            f"{url}: pushing to a server needs its admin key (admin_key=... or ${ADMIN_KEY_ENV})"
        )
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            info = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise DiscoveryError(f"{url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DiscoveryError(f"{url}: {exc}") from None
    address = ExchangeAddress(**info["exchange"])  # its fields, as `/admin/weights` lists them
    if address.host in ("0.0.0.0", "::", ""):  # listening everywhere: dial the host we reached
        address = ExchangeAddress(urlsplit(target).hostname, address.port, address.token)
    return address

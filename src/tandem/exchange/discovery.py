"""Where to push: an engine's exchange address, given directly or asked of a `tandem serve`.

A `WeightSender` target may be ``host:port/token`` (an `LLM`'s ``exchange_address``) or a
server's address (``http://host:port`` or ``host:port``): then ``GET /admin/weights`` with the
admin key returns the exchange endpoint. HTTP only negotiates; the tensor bytes go through
the transports.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from tandem.exchange.address import ExchangeAddress

ADMIN_KEY_ENV = "TANDEM_ADMIN_KEY"


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
        raise DiscoveryError(f"{url}: pushing to a server needs its admin key "
                             f"(admin_key=... or ${ADMIN_KEY_ENV})")  # fmt: skip
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

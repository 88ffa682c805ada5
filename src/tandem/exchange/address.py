"""Where trainer ranks reach an exchange server: ``host:port/token`` (`LLM.exchange_address`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExchangeAddress:
    """An exchange server's endpoint and the token a trainer rank proves first; its string
    form, ``host:port/token``, is what users pass around."""

    host: str
    port: int
    token: str

    @classmethod
    def parse(cls, text: str) -> ExchangeAddress:
        """``host:port/token``; ValueError naming ``text`` for anything else."""
        hostport, slash, token = text.rpartition("/")
        host, _, port = hostport.rpartition(":")
        if not (slash and host and port.isdigit() and token):
            raise ValueError(f"not an exchange address (host:port/token): {text!r}")
        return cls(host, int(port), token)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}/{self.token}"

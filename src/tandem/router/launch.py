"""`tandem router`: one HTTP front over `tandem serve` instances started separately."""

from __future__ import annotations

import dataclasses
import socket

import uvicorn

from tandem.router.app import RouterSettings, build_app


def route(
    replicas: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    settings: RouterSettings | None = None,
    health_interval_s: float = 1.0,
    log_level: str = "warning",
) -> int:
    """Serve until SIGINT / SIGTERM."""
    settings = dataclasses.replace(
        settings or RouterSettings(), health_interval_s=health_interval_s
    )
    app = build_app(settings.fleet(replicas), settings)
    sock = socket.create_server((host, port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=log_level, access_log=False)
    print(
        f"tandem router: on http://{host}:{port} over {len(replicas)} replicas "
        f"({', '.join(replicas)})",
        flush=True,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        print("tandem router: stopped", flush=True)
    return 0

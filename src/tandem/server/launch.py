"""`tandem serve`: start the engine, then the HTTP server; stop both on SIGINT / SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading

import uvicorn

from tandem.fleet.fleet import Fleet
from tandem.server.app import build_app
from tandem.server.async_fleet import AsyncFleet
from tandem.server.chat import ServedChat
from tandem.server.config import ServeConfig
from tandem.server.metrics import Metrics
from tandem.server.state import ServerState

log = logging.getLogger("tandem.serve")


def serve(config: ServeConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    sock = socket.create_server((config.host, config.port))
    host, port = sock.getsockname()[:2]
    engine_config = config.engine_config()
    replicas = engine_config.parallel.data_parallel_size
    log.info("loading %s (dp=%d, tp=%d, pp=%d)", config.model, replicas, config.tp, config.pp)
    try:
        fleet = Fleet.local(engine_config)
    except BaseException:
        sock.close()
        raise
    async_engine = AsyncFleet(fleet, config.max_waiting_requests)
    try:
        tokenizer = async_engine.tokenizer
        chat = ServedChat(None if tokenizer is None else tokenizer.chat_template)
        state = ServerState(config, async_engine, Metrics(async_engine), chat)
        state.lora.load_all(config.lora_modules)  # --lora-modules (LoRAError: cannot start)
        app = build_app(state)
        uv = uvicorn.Config(
            app,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_timeout_s,
            access_log=config.log_level == "debug",
            lifespan="off",
        )
        server = _Server(uv, async_engine, config.shutdown_timeout_s)
        print(
            f"tandem serve: {config.model_name} on http://{host}:{port} "
            f"(dp={replicas}, tp={config.tp}, pp={config.pp}, {fleet.lead.config.dtype}, "
            f"weight version {fleet.weight_version})",
            flush=True,
        )
        # uvicorn re-raises the signal that stopped it once it is done; with these handlers in
        # place that is a no-op, so the engine and its workers are shut down below.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        async_engine.close()
        fleet.shutdown()
        sock.close()
        print("tandem serve: stopped", flush=True)
    return 0


def _ignore(signum, frame) -> None:
    pass


class _Server(uvicorn.Server):
    """On shutdown, requests still running just before the grace period ends are answered
    with 503 "the server is shutting down" instead of a dropped connection."""

    def __init__(self, config: uvicorn.Config, engine: AsyncFleet, grace_s: float):
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        def close():
            threading.Thread(target=self._engine.close, daemon=True).start()

        asyncio.get_running_loop().call_later(max(0.0, self._grace_s - 1.0), close)
        await super().shutdown(sockets)

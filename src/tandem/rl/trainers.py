"""The demo's trainer ranks as subprocesses, driven over one authenticated connection each
(`TRAINERS` messages, `tandem.wire`). A trainer that dies is noticed while waiting for its
report (its socket closes or its process exits): the demo stops with an error instead of
hanging."""

from __future__ import annotations

import os
import secrets
import select
import socket
import subprocess
import sys
import time

from tandem.engine.launcher import start_process
from tandem.rl.messages import (
    TRAINERS,
    Sample,
    ScoreBatch,
    ScoreReport,
    Stop,
    TrainBatch,
    TrainerHello,
    TrainReport,
    WarmupBatch,
)
from tandem.rl.trainer import ENV, TrainerArgs
from tandem.wire import PeerGone, free_port, gather_hellos, recv_frame, send_frame

TRAINER_MODULE = "tandem.rl.trainer"

HELLO_TIMEOUT_S = 30.0  # a trainer that has not proved the token by then is dropped


class TrainerError(RuntimeError):
    """A trainer rank failed or exited."""


class TrainerGroup:
    def __init__(
        self,
        world_size: int,
        model_dir: str,
        exchange_address: str,
        transport: str,
        seed: int,
        start_timeout_s: float = 300.0,
        delta: str = "auto",
    ):
        self._token = secrets.token_hex(16)
        self._listener = socket.create_server(("127.0.0.1", 0))
        host, port = self._listener.getsockname()[:2]
        dist_port = free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.procs = []
        for rank in range(world_size):
            args = TrainerArgs(
                rank,
                world_size,
                dist_port,
                model_dir,
                [host, port],
                self._token,
                exchange_address,
                transport,
                seed,
                delta=delta,
            )
            self.procs.append(  # forked from a template that imported the trainer once
                start_process(
                    ["-m", TRAINER_MODULE],
                    {**env, ENV: args.to_env()},
                    preload=(TRAINER_MODULE,),
                    exclude=(ENV,),
                    timeout=start_timeout_s,
                )
            )
        self.socks: dict[int, socket.socket] = {}
        try:
            self._accept(world_size, time.monotonic() + start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _accept(self, world_size: int, deadline: float) -> None:
        try:
            peers = gather_hellos(
                self._listener,
                self._token,
                TRAINERS,
                TrainerHello,
                world_size,
                deadline,
                self._check_alive,
                HELLO_TIMEOUT_S,
            )
        except TimeoutError as exc:
            raise TrainerError(f"trainer {exc}") from None
        for rank, (sock, _) in peers.items():
            sock.settimeout(120)
            self.socks[rank] = sock

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise TrainerError(f"trainer rank {rank} exited with code {proc.returncode}")

    def step(
        self,
        step: int,
        version: int,
        shares: list[list[Sample]],
        update: bool,
        lr: float,
        is_correction: str = "none",
        is_cap: float = 2.0,
    ) -> list[TrainReport]:
        """Send every rank its share, wait for all reports (each rank pushes after updating;
        ``update=False`` only scores: ``lr`` is unused then). ``is_correction`` and ``is_cap``:
        how the loss corrects the engine/trainer mismatch (`tandem.rl.grpo.correct_mismatch`)."""
        batches = [
            TrainBatch(step, version, update, lr, shares[r], is_correction, is_cap)
            for r in self._ranks
        ]
        return self._exchange(batches)

    def warmup(
        self, step: int, version: int, shares: list[list[list[list[int]]]], push: bool, lr: float
    ) -> list[TrainReport]:
        """One supervised step on every rank's share of [prompt_ids, target_ids] examples."""
        batches = [WarmupBatch(step, version, push, lr, shares[r]) for r in self._ranks]
        return self._exchange(batches)

    def score(
        self, step: int, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float]]:
        """The trainers' next-token log-softmax rows at ``positions`` (every rank runs the same
        forward, as FSDP2 needs; rank 0's rows are returned)."""
        reports = self._exchange([ScoreBatch(step, sequences, positions) for _ in self._ranks])
        return reports[0].logprobs

    @property
    def _ranks(self) -> list[int]:
        return sorted(self.socks)

    def _exchange(self, messages: list) -> list[TrainReport | ScoreReport]:
        for rank, msg in zip(self._ranks, messages, strict=True):
            send_frame(self.socks[rank], TRAINERS.encode(msg))
        reports = [self._report(rank) for rank in self._ranks]
        errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
        if errors:
            raise TrainerError("; ".join(errors))
        return reports

    def _report(self, rank: int) -> TrainReport | ScoreReport:
        sock = self.socks[rank]
        while not select.select([sock], [], [], 0.5)[0]:  # a whole frame is read at once below
            self._check_alive()
        try:
            return TRAINERS.decode(recv_frame(sock))
        except (PeerGone, OSError) as exc:
            raise TrainerError(f"trainer rank {rank} is gone ({exc})") from None

    def close(self) -> None:
        for sock in self.socks.values():
            try:
                send_frame(sock, TRAINERS.encode(Stop()))
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.socks.values():
            sock.close()
        self._listener.close()

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

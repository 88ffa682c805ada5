"""A `tandem serve` subprocess (benchmarks, tests, the verl replica): start it, find its URL,
read its peak RSS, stop it.

With this interpreter, the server is forked from a template that imported the server's modules
once (`tandem.engine.launcher`): the second and later servers of a process start without
importing torch again. The server's output (stdout and stderr together) is drained by a
thread so it can never block on a full pipe; its last lines go into the error when the server
fails to start.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tandem.engine.launcher import start_process

_LISTENING = re.compile(r"^tandem (?:serve: (\S+)|router:) on (http://\S+) ")
# what `tandem serve` and `tandem router` import before they listen: one template for both
PRELOAD = ("tandem.cli", "tandem.server.launch", "tandem.router.launch")


class ServerProcess:
    """``python -m tandem.cli serve --port 0 *args`` (``args`` name the model: ``--model DIR``
    or ``--config FILE``), or with ``command="router"`` a `tandem router` (``args``: its
    ``--replica URL`` flags); use as a context manager. ``python``: the interpreter (default:
    this one; tests run in vLLM's venv start tandem's)."""

    def __init__(
        self,
        args: list[str],
        start_timeout_s: float = 180.0,
        command: str = "serve",
        python: str | None = None,
    ):
        argv = ["-m", "tandem.cli", command, "--port", "0", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        read_fd, write_fd = os.pipe()
        try:
            if python is None or python == sys.executable:
                # the forked server opens the pipe's write end through /proc, so this process
                # holds it until the server has printed (or exited)
                here = f"/proc/{os.getpid()}/fd/{write_fd}"
                self.proc = start_process(argv, env, preload=PRELOAD, stdout=here, stderr=here)
            else:
                self.proc = subprocess.Popen(
                    [python, *argv], stdout=write_fd, stderr=subprocess.STDOUT, env=env
                )
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        self._output = os.fdopen(read_fd, encoding="utf-8", errors="replace")
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()
        self.url = ""
        self.model_name = ""
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        try:
            while not self._ready.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                if self.proc.poll() is not None or time.monotonic() >= deadline:
                    break
        finally:
            os.close(write_fd)  # the server's copies (and its workers') remain: EOF once gone
        if not self._ready.wait(5.0 if self.proc.poll() is not None else 0) or not self.url:
            self.stop()
            raise RuntimeError(f"tandem {command} {' '.join(args)} did not start:\n{self.output}")

    @property
    def output(self) -> str:
        """The server's last lines of output (stdout and stderr)."""
        return "".join(self._tail).strip()

    def _drain(self) -> None:
        with self._output:
            for line in self._output:
                self._tail.append(line)
                if not self._ready.is_set() and (match := _LISTENING.match(line)):
                    self.model_name, self.url = match.group(1) or "", match.group(2)
                    self._ready.set()
        self._ready.set()  # exited before listening: wake the constructor

    @property
    def pid(self) -> int:
        return self.proc.pid

    def peak_rss_bytes(self) -> int | None:
        """The server process's peak resident set (VmHWM), where /proc has it; worker processes
        (tp/pp > 1) are not counted."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        return int(match.group(1)) * 1024 if match else None

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int:
        """``sig`` (SIGTERM: a clean shutdown), wait up to ``grace_s``, then SIGKILL; returns
        the exit code (0: clean)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""A `tandem serve` subprocess for benchmarks: start it, find its URL, read its peak RSS, stop it.

The server's output (stdout and stderr together) is drained by a thread so it can never block
on a full pipe; its last lines go into the error when the server fails to start.
"""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

_LISTENING = re.compile(r"^tandem serve: (\S+) on (http://\S+) ")


class ServerProcess:
    """``python -m tandem.cli serve --model DIR --port 0 *flags``; use as a context manager."""

    def __init__(self, model_dir: Path, flags: list[str], start_timeout_s: float = 180.0):
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir),
               "--port", "0", *flags]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._ready = threading.Event()
        self.url = ""
        self.model_name = ""
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(start_timeout_s) or not self.url:
            self.stop()
            output = "".join(self._tail).strip()
            raise RuntimeError(f"tandem serve {' '.join(flags)} did not start:\n{output}")

    def _drain(self) -> None:
        for line in self._proc.stdout:
            self._tail.append(line)
            if not self._ready.is_set() and (match := _LISTENING.match(line)):
                self.model_name, self.url = match.group(1), match.group(2)
                self._ready.set()
        self._ready.set()  # exited before listening: wake the constructor

    @property
    def pid(self) -> int:
        return self._proc.pid

    def peak_rss_bytes(self) -> int | None:
        """The server process's peak resident set (VmHWM), where /proc has it; worker processes
        (tp/pp > 1) are not counted."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        return int(match.group(1)) * 1024 if match else None

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns the exit code (0: clean)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return self._proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

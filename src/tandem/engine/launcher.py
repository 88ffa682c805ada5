"""Worker processes forked from a template that imported torch and tandem once.

A worker must import torch and tandem before it does anything: about 2 s of CPU per process,
most of an engine's start on a small model and all of it again for every replica a fleet
adds or heals. With ``worker_start="fork"`` (Linux) the engine's host keeps one *template*
process per interpreter set-up (the executable and the variables that shape an
interpreter's start: ``PYTHON*``, ``TANDEM_*``, the loader's, the thread libraries'); the
template imports the worker's modules once and forks a worker per request. A forked worker
takes the rest of its request's environment before it runs, then is the same worker
``python -m tandem.engine.worker`` would be.

The template runs nothing but imports (no torch op, no thread pool started, no device
touched), so forking it is safe. Requests and answers are JSON lines over pipes, never
pickle: ``{"id", "env"}`` in; ``{"id", "pid"}``, ``{"id", "error"}`` and
``{"pid", "exit"}`` (a worker's exit status, reaped by the template, its parent) out. A
template lives until its host process closes it or exits; then it ends once its last
worker has.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

TEMPLATE_MODULE = "tandem.engine.launcher"
MAX_TEMPLATES = 2  # set-ups kept warm per process; an older one is closed (its workers live)
# variables read as an interpreter starts or loads its libraries: a template is per set-up
STARTUP_PREFIXES = (
    "PYTHON",
    "TANDEM_",
    "LD_",
    "MALLOC_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
)


class WorkerStartError(RuntimeError):
    """A worker could not be started from its template (the template died or did not answer)."""


def startup_key(env: dict[str, str], exclude: tuple[str, ...] = ()) -> tuple:
    """What a template shares with every worker it forks: the interpreter and the startup
    variables of ``env`` (``exclude``: per-worker variables, set at fork)."""
    startup = sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES))
    return (sys.executable, tuple((k, v) for k, v in startup if k not in exclude))


class ForkedWorker:
    """A worker forked by a `Template`: the part of `subprocess.Popen` an executor uses
    (``pid``, ``returncode``, ``poll``, ``wait``, ``terminate``, ``kill``)."""

    def __init__(self, template: Template, pid: int):
        self._template, self.pid = template, pid
        self.args = f"worker pid {pid} forked by template pid {template.pid}"

    @property
    def returncode(self) -> int | None:
        return self._template.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._template.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """One template process and the workers it forked, seen from the host process.

    A reader thread takes the template's answers; `start` and `wait_exit` wait on them with
    a deadline. When the template is gone, a worker whose exit it did not report is looked
    up by pid (it was re-parented; its exit code is then unknown: 255)."""

    def __init__(self, env: dict[str, str], exclude: tuple[str, ...]):
        self.key = startup_key(env, exclude)
        base = {k: v for k, v in env.items() if k not in exclude}
        reply_r, reply_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", TEMPLATE_MODULE, str(reply_w)],
                stdin=subprocess.PIPE,
                env=base,
                pass_fds=(reply_w,),
            )
        finally:
            os.close(reply_w)
        self.pid = self._proc.pid
        self._replies = os.fdopen(reply_r, "rb")
        self._cond = threading.Condition()
        self._started: dict[int, int | str] = {}  # request id -> pid or error
        self._exits: dict[int, int] = {}  # pid -> exit code
        self._next_id = 0
        self._gone = False
        self._closed = False
        threading.Thread(target=self._read, name=f"template-{self.pid}", daemon=True).start()

    def _read(self) -> None:
        for line in self._replies:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    self._exits[msg["pid"]] = msg["exit"]
                else:
                    self._started[msg["id"]] = msg.get("pid", msg.get("error"))
                self._cond.notify_all()
        self._proc.wait()  # the reply pipe closes as the template exits
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    @property
    def usable(self) -> bool:
        return not (self._gone or self._closed)

    def start(self, env: dict[str, str], timeout: float) -> ForkedWorker:
        """Fork a worker that runs with ``env``; raise `WorkerStartError` if the template
        has not forked it within ``timeout`` seconds (its first start imports torch)."""
        with self._cond:
            request, self._next_id = self._next_id, self._next_id + 1
            try:
                line = {"id": request, "env": env, "cwd": os.getcwd()}
                self._proc.stdin.write(json.dumps(line).encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise WorkerStartError(f"template pid {self.pid} is gone ({exc})") from None
            deadline = time.monotonic() + timeout
            while request not in self._started and not self._gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close()
                    self._proc.kill()  # hung: no later request may wait on it
                    raise WorkerStartError(
                        f"template pid {self.pid} forked no worker within {timeout:g} s"
                    )
                self._cond.wait(left)
            answer = self._started.pop(request, None)
            if not isinstance(answer, int):
                raise WorkerStartError(
                    f"template pid {self.pid} could not fork a worker: "
                    f"{answer or f'it exited with code {self._proc.returncode}'}"
                )
            return ForkedWorker(self, answer)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits or not self._gone:
                return self._exits.get(pid)
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return 255  # re-parented when its template died, then exited: code unknown

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.exit_code(pid)) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            with self._cond:
                if pid not in self._exits:
                    self._cond.wait(0.2 if self._gone or left is None else min(left, 0.2))
        return code

    def close(self) -> None:
        """No more workers from this template: it exits once the ones it forked have."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            try:
                self._proc.stdin.close()
            except OSError:
                pass


_templates: dict[tuple, Template] = {}
_lock = threading.Lock()
# a forked copy of this process has no reader threads: it starts templates of its own
os.register_at_fork(after_in_child=_templates.clear)


def start_worker(env: dict[str, str], exclude: tuple[str, ...], timeout: float) -> ForkedWorker:
    """A worker forked, with ``env``, from this process's template for ``env``'s set-up
    (started on first use; ``exclude``: the per-worker variables, left out of the set-up)."""
    key = startup_key(env, exclude)
    with _lock:
        template = _templates.get(key)
        if template is None or not template.usable:
            template = _templates[key] = Template(env, exclude)
            while len(_templates) > MAX_TEMPLATES:  # the oldest set-up first
                _templates.pop(next(iter(_templates))).close()
        else:  # most recently used last
            _templates[key] = _templates.pop(key)
    return template.start(env, timeout)


# ---- the template process ------------------------------------------------------------------


def _serve(reply_fd: int) -> dict[str, str] | None:
    """Fork a worker per request until stdin closes and every worker has exited. Returns
    ``None`` in the template; in a forked worker, the environment it must run with."""
    from tandem.engine.worker import name_process  # the point: imported once, before any fork

    name_process("tandem-template")

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    replies = os.fdopen(reply_fd, "wb", buffering=0)
    pending = b""  # requests read but not yet served (lines, unbuffered: select sees the fd)
    live: set[int] = set()
    reading = True

    def reply(msg: dict) -> None:
        try:
            replies.write(json.dumps(msg).encode() + b"\n")
        except BrokenPipeError:
            pass  # the host process is gone; its workers end when their engine's link does

    while reading or live or b"\n" in pending:
        if b"\n" not in pending:
            ready, _, _ = select.select([wake_r, 0] if reading else [wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
            if 0 in ready:
                chunk = os.read(0, 65536)
                reading = bool(chunk)
                pending += chunk
        while live:  # reap: a worker's exit, reported to the host
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            live.discard(pid)
            reply({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})
        if b"\n" not in pending:
            continue
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        try:
            pid = os.fork()
        except OSError as exc:
            reply({"id": request["id"], "error": f"fork: {exc}"})
            continue
        if pid == 0:  # the worker: drop the template's plumbing, take the request's env
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            replies.close()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            try:
                os.chdir(request["cwd"])  # the host's, now (a template keeps its first)
            except OSError:
                pass  # gone: the worker starts where its template did
            return request["env"]
        live.add(pid)
        reply({"id": request["id"], "pid": pid})
    return None


def main() -> int:
    env = _serve(int(sys.argv[1]))
    if env is None:
        return 0
    import random

    from tandem.engine import worker

    os.environ.clear()
    os.environ.update(env)
    random.seed()  # not the template's state, shared by every fork
    sys.argv = [worker.__file__]
    return worker.main()


if __name__ == "__main__":
    sys.exit(main())

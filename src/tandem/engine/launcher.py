"""Processes forked from a template that imported their modules once.

A worker must import torch and tandem before it does anything: about 2 s of CPU per process,
most of an engine's start on a small model and all of it again for every replica a fleet
adds or heals. With ``worker_start="fork"`` (Linux) the engine's host keeps one *template*
process per interpreter set-up (the executable, the variables that shape an interpreter's
start: ``PYTHON*``, ``TANDEM_*``, the loader's, the thread libraries', and the modules to
preload); the template imports those modules once and forks a process per request. A forked
process takes the rest of its request's environment and working directory, then runs its
module or script as ``__main__``: the same process ``python -m tandem.engine.worker`` (or
``python script.py ...``) would be, started in a fraction of the time. `start_process` does
this for any Python entry point: engine workers, a trainer's ranks.

The template runs nothing but imports (no torch op, no thread pool started, no device
touched), so forking it is safe. Requests and answers are JSON lines over pipes, never
pickle: ``{"id", "argv", "env", "cwd"}`` in; ``{"id", "pid"}``, ``{"id", "error"}`` and
``{"pid", "exit"}`` (a process's exit status, reaped by the template, its parent) out. A
template lives until its host process closes it or exits; then it ends once its last
process has.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import warnings

TEMPLATE_MODULE = "tandem.engine.launcher"
PR_SET_NAME = 15  # prctl option, <linux/prctl.h>
MAX_TEMPLATES = 4  # set-ups kept warm per process; an older one is closed (its workers live)
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
    """A process could not be started from its template (the template died or did not
    answer)."""


def startup_key(env: dict[str, str], exclude: tuple[str, ...], preload: tuple[str, ...]) -> tuple:
    """What a template shares with every process it forks: the interpreter, the startup
    variables of ``env`` (``exclude``: per-process variables, set at fork) and the modules
    it imported."""
    startup = sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES))
    return (sys.executable, tuple((k, v) for k, v in startup if k not in exclude), preload)


class ForkedProcess:
    """A process forked by a `Template`: the part of `subprocess.Popen` an executor uses
    (``pid``, ``returncode``, ``poll``, ``wait``, ``terminate``, ``kill``)."""

    def __init__(self, template: Template, pid: int):
        self._template, self.pid = template, pid
        self.args = f"pid {pid} forked by template pid {template.pid}"

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

    def __init__(self, env: dict[str, str], exclude: tuple[str, ...], preload: tuple[str, ...]):
        base = {k: v for k, v in env.items() if k not in exclude}
        reply_r, reply_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", TEMPLATE_MODULE, str(reply_w), ",".join(preload)],
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

    def start(
        self, argv: list[str], env: dict[str, str], timeout: float, output: dict[str, tuple]
    ) -> ForkedProcess:
        """Fork a process that runs ``argv`` with ``env`` (``output``: the files its stdout
        and stderr go to, each ``(path, append)``); raise `WorkerStartError` if the template
        has not forked it within ``timeout`` seconds (its first start imports)."""
        with self._cond:
            request, self._next_id = self._next_id, self._next_id + 1
            try:
                line = {"id": request, "argv": argv, "env": env, "cwd": os.getcwd(), **output}
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
                        f"template pid {self.pid} forked no process within {timeout:g} s"
                    )
                self._cond.wait(left)
            answer = self._started.pop(request, None)
            if not isinstance(answer, int):
                raise WorkerStartError(
                    f"template pid {self.pid} could not fork a process: "
                    f"{answer or f'it exited with code {self._proc.returncode}'}"
                )
            return ForkedProcess(self, answer)

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


def start_process(
    argv: list[str],
    env: dict[str, str],
    *,
    preload: tuple[str, ...],
    exclude: tuple[str, ...] = (),
    timeout: float = 300.0,
    stdout: str | None = None,
    stderr: str | None = None,
) -> ForkedProcess | subprocess.Popen:
    """``python *argv`` (``["-m", module, ...]`` or ``[script, ...]``) with ``env``, forked
    from this process's template for ``env``'s set-up and ``preload`` (the modules it imports
    first; started on first use). ``exclude``: per-process variables, left out of the set-up.
    ``stdout``, ``stderr``: files (paths) to write them to, else where this process's go now
    (appended to; the template's own, fixed when it started, where that cannot be opened).
    Raises `WorkerStartError` past ``timeout`` seconds. Elsewhere than Linux: a fresh
    interpreter (`subprocess.Popen`)."""
    files = (("stdout", stdout), ("stderr", stderr))
    if sys.platform != "linux":
        opened = {k: open(v, "wb") for k, v in files if v}  # noqa: SIM115 (the child's)
        try:
            return subprocess.Popen([sys.executable, *argv], env=env, **opened)
        finally:
            for f in opened.values():
                f.close()
    key = startup_key(env, exclude, preload)
    with _lock:
        template = _templates.get(key)
        if template is None or not template.usable:
            template = _templates[key] = Template(env, exclude, preload)
            while len(_templates) > MAX_TEMPLATES:  # the oldest set-up first
                _templates.pop(next(iter(_templates))).close()
        else:  # most recently used last
            _templates[key] = _templates.pop(key)
    here = {"stdout": f"/proc/{os.getpid()}/fd/1", "stderr": f"/proc/{os.getpid()}/fd/2"}
    output = {k: (os.path.abspath(v), False) if v else (here[k], True) for k, v in files}
    return template.start(argv, env, timeout, output)


def name_process(name: str) -> None:
    """Show ``name`` (at most 15 bytes) for this process in ps, top and /proc/PID/comm
    (Linux; elsewhere nothing)."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


# ---- the template process ------------------------------------------------------------------


def _serve(reply_fd: int, preload: list[str]) -> dict | None:
    """Fork a process per request until stdin closes and every process has exited. Returns
    ``None`` in the template; in a forked process, its request."""
    for module in preload:  # the point: imported once, before any fork
        importlib.import_module(module)
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
        if pid == 0:  # the new process: drop the template's plumbing
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            replies.close()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            for fd, name in ((1, "stdout"), (2, "stderr")):
                path, append = request[name]
                mode = os.O_WRONLY | (os.O_APPEND if append else os.O_CREAT | os.O_TRUNC)
                try:
                    out = os.open(path, mode, 0o600)
                except OSError:
                    continue  # the host's is a socket, say: the template's then
                os.dup2(out, fd)
                os.close(out)
            return request
        live.add(pid)
        reply({"id": request["id"], "pid": pid})
    return None


def main() -> None:
    preload = [m for m in sys.argv[2].split(",") if m]
    request = _serve(int(sys.argv[1]), preload)
    if request is None:
        return
    os.environ.clear()
    os.environ.update(request["env"])
    try:
        os.chdir(request["cwd"])  # the host's now (a template keeps the one it started in)
    except OSError:
        pass  # gone: it starts where its template did
    random.seed()  # not the template's state, shared by every fork
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()  # as ``python -m``
        # preloaded, so runpy finds it imported already; it runs anew as __main__ all the same
        warnings.filterwarnings("ignore", ".*found in sys.modules", RuntimeWarning)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as ``python script.py``
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

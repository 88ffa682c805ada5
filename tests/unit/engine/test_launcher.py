"""Workers forked from a template (`tandem.engine.launcher`): each runs with its request's
environment, reports its exit (code or signal) to the host, and a template is shared only by
workers of one interpreter set-up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config import EngineConfig
from tandem.engine.launcher import start_process
from tandem.engine.worker import ENV, WORKER_MODULE, WorkerArgs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork templates are Linux-only")


def _env(tmp_path: Path, port: int, extra_path: str | None = None) -> dict[str, str]:
    """A rank-0 worker of a TP=2 engine whose peer never comes: it connects to ``port``,
    then waits in the rendezvous until it is killed."""
    config = EngineConfig(model="m", tensor_parallel_size=2, worker_start_timeout_s=120)
    args = WorkerArgs(
        rank=0,
        local_rank=5,
        local_world_size=6,
        config=config.model_dump(),
        rendezvous=f"file://{tmp_path}/store",
        control_host="127.0.0.1",
        control_port=port,
        token="t" * 32,
        model_modules=[],
    )
    path = [extra_path] if extra_path else []
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*path, *sys.path]), ENV: args.to_env()}


def _worker(env: dict[str, str]):
    """An engine worker forked with ``env``, as the engine starts its workers."""
    return start_process(
        ["-m", WORKER_MODULE], env, preload=(WORKER_MODULE,), exclude=(ENV,), timeout=60
    )


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_forked_worker_runs_its_request_and_reports_the_signal_that_killed_it(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(60)
        worker = _worker(_env(tmp_path, listener.getsockname()[1]))
        conn, _ = listener.accept()  # it read host, port and token from its request's env
        conn.close()
    try:
        assert Path(f"/proc/{worker.pid}/comm").read_text().strip() == "tandem-w5"
        template = _parent(worker.pid)
        assert Path(f"/proc/{template}/comm").read_text().strip() == "tandem-template"
        assert _parent(template) == os.getpid()
        assert worker.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(timeout=0.2)
    finally:
        worker.kill()
    assert worker.wait(timeout=30) == -signal.SIGKILL == worker.returncode


def test_a_worker_that_fails_reports_its_exit_code(tmp_path):
    env = {**_env(tmp_path, 1), ENV: "not json"}
    worker = _worker(env)
    assert worker.wait(timeout=60) == 1


def test_one_template_per_interpreter_setup(tmp_path):
    """Workers of one set-up share a template; a different PYTHONPATH (a sitecustomize a
    fault test plants, say) gets a template of its own, started with it."""
    (tmp_path / "site").mkdir()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        same = [_worker(_env(tmp_path / f"s{i}", port)) for i in range(2)]
        other = _worker(_env(tmp_path / "s2", port, str(tmp_path / "site")))
        try:
            assert _parent(same[0].pid) == _parent(same[1].pid) != _parent(other.pid)
        finally:
            for worker in (*same, other):
                worker.kill()
    assert [w.wait(timeout=30) for w in (*same, other)] == [-signal.SIGKILL] * 3


def test_a_script_runs_forked_as_python_would_run_it(tmp_path, capfd):
    """Any entry point (a trainer's ranks, say): its argv, its env, the host's working
    directory, its own folder first on sys.path, its exit code; its stdout to the file it is
    given, its stderr where this process's goes now (here: pytest's capture of this test)."""
    (tmp_path / "neighbour.py").write_text("NAME = 'neighbour'\n")
    script = tmp_path / "entry.py"
    script.write_text(
        "import json, os, sys\n"
        "import neighbour\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv, 'env': os.environ['LAUNCH_TEST'],\n"
        "                      'cwd': os.getcwd(), 'neighbour': neighbour.NAME}))\n"
        "    if sys.argv[1] != 'warm':\n"
        "        print('to stderr', file=sys.stderr)\n"
        "    sys.exit(7)\n"
    )
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "LAUNCH_TEST": "yes"}
    with capfd.disabled():  # its template starts while this process's stderr is elsewhere
        warm = start_process([str(script), "warm"], env, preload=("json",), stdout=str(out))
        assert warm.wait(timeout=60) == 7
    proc = start_process([str(script), "x"], env, preload=("json",), stdout=str(out))
    assert proc.wait(timeout=60) == 7
    assert json.loads(out.read_text()) == {
        "argv": [str(script), "x"],
        "env": "yes",
        "cwd": os.getcwd(),
        "neighbour": "neighbour",
    }
    assert capfd.readouterr().err == "to stderr\n"

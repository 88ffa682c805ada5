"""Trainers for the push tests: the reference model in transformers, and the 2-rank FSDP2
trainer (`fsdp_trainer.py`) or rolling trainer (`rolling_trainer.py`) started as processes
(trainer ranks forked from a template that imported their modules once: `start_rank`)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import transformers

from support.paths import SUPPORT, rendezvous
from tandem.engine.launcher import ForkedProcess, start_process

# what an FSDP2 trainer rank imports before it does anything (seconds of CPU per process)
FSDP_TRAINER = (
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "tandem.exchange",
)


def start_rank(
    script,
    args: list[str],
    env: dict,
    preload: tuple[str, ...],
    stdout: str | None = None,
    stderr: str | None = None,
) -> ForkedProcess:
    """``python script *args`` as its own process, forked from a template that imported
    ``preload`` once (tandem's launcher, as engine workers start); its output to the files
    given, else where this process's goes."""
    return start_process(
        [str(script), *args], env, preload=preload, timeout=120, stdout=stdout, stderr=stderr
    )


def hf_model(path: str) -> torch.nn.Module:
    """The model at ``path`` in transformers, float32, eval mode: a trainer and a reference."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def scale(model: torch.nn.Module, factor: float) -> None:
    """Every weight of ``model`` times ``factor`` (a training step that moves every weight)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


def run_trainer(
    model_dir: str,
    address: str,
    version: int,
    transport: str,
    mode: str = "staged",
    *,
    die: bool = False,
) -> list[int]:
    """Two FSDP2 trainer processes push ``model_dir``'s weights (moved, see the script) as
    ``version`` into ``address``; their exit codes."""
    script = SUPPORT / "fsdp_trainer.py"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    extra = ["die"] if die else []
    argv = [rendezvous(), model_dir, address, str(version), transport, mode, *extra]
    procs = [start_rank(script, [str(r), *argv], env, FSDP_TRAINER) for r in range(2)]
    return wait_ranks(procs, 120)


def wait_ranks(procs: list[ForkedProcess | subprocess.Popen], timeout: float) -> list[int]:
    """The ranks' exit codes (forked or `subprocess.Popen` processes), each waited on for up to
    ``timeout`` seconds; any still running then (the wait failed) is killed and reaped."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def rolling_trainer(
    trainer_dir: str, address: str, version: int, when: str, transport: str = "shm"
) -> subprocess.Popen:
    """`rolling_trainer.py`: one trainer process that pushes ``version`` rolling and dies
    ``when`` told (its stdout says how far it got)."""
    script = SUPPORT / "rolling_trainer.py"
    return subprocess.Popen(
        [sys.executable, str(script), trainer_dir, address, str(version), when, transport],
        stdout=subprocess.PIPE,
        text=True,
    )

"""Engine parameters in shared memory (shm in_place): moved once, written through a mapping."""

import gc
import mmap
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from tandem.exchange.transports.memory import MappedArena, MappedMemory, ParamArena


def test_parameters_move_into_the_arena_and_a_mapping_writes_the_live_tensors():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    arena = ParamArena(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])  # the values moved with them
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    mapped = MappedArena(arena.handle())
    mapped.param("0.weight", torch.float32)[1:3].fill_(7.0)
    assert (model[0].weight[1:3] == 7.0).all() and not (model[0].weight[0] == 7.0).any()
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs


def test_tied_parameters_stay_one_tensor():
    model = nn.Module()
    model.a = nn.Linear(4, 4, bias=False)
    model.b = nn.Linear(4, 4, bias=False)
    model.b.weight = model.a.weight
    ParamArena(model)
    assert model.a.weight is model.b.weight


def test_a_recycled_descriptor_is_refused():
    arena = ParamArena(nn.Linear(4, 4))
    pid, fd, inode, size, entries = arena.handle()
    with pytest.raises(RuntimeError, match="not the peer's parameter arena"):
        MappedArena([pid, fd, inode + 1, size, entries])


def _names(pid: int, fd: int, inode: int) -> bool:
    """Whether process ``pid``'s descriptor ``fd`` is the memfd of ``inode``."""
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
    except OSError:
        return False


def test_the_descriptor_a_handle_names_lives_as_long_as_the_memory():
    """An arena dropped while the parameters still view its memory (an in-process executor
    shut down while its model lives on) keeps the descriptor its handle names, so the handle
    still maps that memory; the descriptor goes with the memory's last view. (It used to close
    with the arena object while the mapping's own descriptor kept the memory: a handle naming
    live memory that no longer opened.)"""
    model = nn.Linear(4, 4)
    arena = ParamArena(model)
    wire = arena.handle()
    pid, fd, inode = wire[:3]
    del arena
    gc.collect()
    assert _names(pid, fd, inode)
    MappedArena(wire).param("weight", torch.float32).fill_(3.0)
    assert (model.weight == 3.0).all()
    del model
    gc.collect()
    assert not _names(pid, fd, inode)


def test_a_handle_whose_descriptor_is_closed_is_refused_naming_why():
    """A handle naming a descriptor the process no longer holds is refused, even while the
    memory lives on through another descriptor (no other one is searched for): the error says
    the process is alive but holds no such descriptor."""
    fd = os.memfd_create("tandem-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    held = mmap.mmap(fd, 4096)  # a descriptor of its own keeps the memory
    wire = [os.getpid(), fd, os.fstat(fd).st_ino, 4096]
    os.close(fd)
    with pytest.raises(RuntimeError, match=f"alive, holding no descriptor {fd}"):
        MappedMemory(wire)
    held.close()


def test_a_handle_of_a_process_that_exited_is_refused_naming_why():
    """A process killed but not yet reaped still has ``/proc/PID`` and no descriptor at all:
    the error says it exited (it used to say "alive")."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import os, sys; fd = os.memfd_create('tandem-test'); os.ftruncate(fd, 4096); "
                "print(os.getpid(), fd, os.fstat(fd).st_ino, flush=True); sys.stdin.read()"
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, fd, inode = map(int, child.stdout.readline().split())
        MappedMemory([pid, fd, inode, 4096])  # mapped while it lives
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(pid) not in ("Z", "X", None) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match=f"process {pid} exited"):
            MappedMemory([pid, fd, inode, 4096])
    finally:
        child.kill()
        child.wait()


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None

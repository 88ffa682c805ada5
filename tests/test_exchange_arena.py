"""Engine parameters in shared memory (shm in_place): moved once, written through a mapping."""

import pytest
import torch
from torch import nn

from tandem.exchange.transports.memory import MappedArena, ParamArena


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


def test_a_closed_descriptor_of_live_memory_is_found_through_its_mapping():
    """The descriptor a handle names may be closed while the memory lives on (seen for an
    engine worker's arena): the peer's other descriptor of the same memfd maps it; a handle
    of other memory is still refused."""
    import mmap
    import os

    from tandem.exchange.transports.memory import MappedMemory

    fd = os.memfd_create("tandem-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    held = mmap.mmap(fd, 4096)  # holds a descriptor of its own, as a worker's arena does
    held[:3] = bytes([7, 8, 9])
    wire = [os.getpid(), fd, os.fstat(fd).st_ino, 4096]
    os.close(fd)
    assert MappedMemory(wire).data[:3].tolist() == [7, 8, 9]
    with pytest.raises(RuntimeError):
        MappedMemory([wire[0], wire[1], wire[2] + 12345, 4096])
    held.close()

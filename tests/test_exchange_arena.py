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

"""The world of a plain module: one process, whose collectives do nothing (gloo ranks run in
the other tests of this package)."""

import dataclasses

import pytest
import torch
from torch import nn

from bigbatch.parallel.world import World, init_from_env


def test_one_process_by_default():
    world = World()
    assert (world.rank, world.size, world.group, world.sharded) == (0, 1, None, False)
    assert not world.distributed
    with pytest.raises(dataclasses.FrozenInstanceError):
        world.size = 2


def test_the_collectives_of_one_process_hand_back_what_they_get():
    world = World()
    tensor = torch.tensor([1.0, 2.0])
    assert world.all_reduce_sum(tensor) is tensor and tensor.tolist() == [1.0, 2.0]
    assert world.all_gather_object({"a": 1}) == [{"a": 1}]
    box = object()
    assert world.broadcast_object(box) is box


def test_a_plain_module_is_one_process():
    assert World.of(nn.Sequential(nn.Linear(3, 4), nn.ReLU())) == World()


def test_without_torchrun_init_from_env_is_one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_from_env() == World()
    monkeypatch.delenv("WORLD_SIZE")
    assert init_from_env() == World()

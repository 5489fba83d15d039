"""What a loop asks about its model's data parallelism, for a plain module (one process).

The DDP and FSDP2 sides run on gloo ranks in tests/parallel/test_adaptive_ddp.py and
test_fsdp.py.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from bigbatch.parallel import ddp
from bigbatch.parallel.world import World


def test_unwrap_returns_a_plain_module_itself():
    model = nn.Linear(3, 2)
    assert ddp.unwrap(model) is model


@pytest.mark.parametrize("last", [False, True])
def test_a_plain_module_accumulates_without_a_context_of_its_own(last):
    model = nn.Linear(3, 2)
    assert isinstance(ddp.accumulating(model, last), contextlib.nullcontext)


def test_a_plain_module_has_no_registered_hook():
    assert ddp.registered_hook(nn.Linear(3, 2)) is None


def test_registering_no_hook_on_a_plain_module_does_nothing():
    model = nn.Linear(3, 2)
    ddp.register(model, None)
    assert not hasattr(model, "_comm_hooks")


def test_a_hook_on_a_plain_module_is_refused():
    with pytest.raises(ValueError, match="comm_hook needs a DistributedDataParallel model"):
        ddp.register(nn.Linear(3, 2), (None, default_hooks.allreduce_hook))


class Counter:
    """A hook state that keeps state of its own (as error feedback does)."""

    def __init__(self, count=0):
        self.count = count

    def state_dict(self):
        return {"count": torch.tensor(self.count)}

    def load_state_dict(self, state):
        self.count = int(state["count"])


def test_hook_state_round_trips_on_one_process():
    world = World()
    saved = ddp.hook_state_dict((Counter(5), default_hooks.allreduce_hook), world)
    assert saved == [{"count": torch.tensor(5)}]
    fresh = Counter()
    ddp.load_hook_state_dict((fresh, default_hooks.allreduce_hook), saved, world)
    assert fresh.count == 5
    other = Counter()  # saved on 2 ranks: each rank's own state has no owner here
    ddp.load_hook_state_dict((other, default_hooks.allreduce_hook), saved * 2, world)
    assert other.count == 0
    assert ddp.hook_state_dict((None, default_hooks.allreduce_hook), world) is None
    assert ddp.hook_state_dict(None, world) is None


def test_a_second_hook_is_refused_and_the_one_in_use_is_still_read(one_rank):
    # DDP lists a hook before its C++ side refuses a second one: the refused hook was then
    # read as the one in use (a user's lossy fp16 reduction taken as lossless)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match="has a comm hook already; pass yours as comm_hook"):
        ddp.register(model, (None, default_hooks.allreduce_hook))
    assert ddp.registered_hook(model) == (None, default_hooks.fp16_compress_hook)

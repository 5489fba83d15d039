"""Which ``(state, hook)`` pairs reduce gradients exactly (the two-group hook itself runs on gloo
ranks in tests/parallel/test_adaptive_ddp.py)."""

from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from bigbatch.parallel.hooks import TwoGroupCosine, is_lossless


def my_hook(state, bucket):  # a user's own reduction: bigbatch cannot know what it does
    raise AssertionError("never called")


@pytest.mark.parametrize(
    "comm_hook, lossless",
    [
        (None, True),  # DDP's own all-reduce
        ((None, default_hooks.allreduce_hook), True),
        ((None, default_hooks.fp16_compress_hook), False),
        ((None, my_hook), False),
        # a state that says so is believed, whatever the hook
        ((SimpleNamespace(lossless=False), default_hooks.allreduce_hook), False),
        ((SimpleNamespace(lossless=True), my_hook), True),
    ],
    ids=["none", "allreduce", "fp16", "another", "state-lossy", "state-lossless"],
)
def test_is_lossless(comm_hook, lossless):
    assert is_lossless(comm_hook) is lossless


def test_the_two_group_cosine_needs_two_ranks(one_rank):
    with pytest.raises(ValueError, match="the two-group cosine needs at least 2 ranks"):
        TwoGroupCosine([list(nn.Linear(3, 2).parameters())])

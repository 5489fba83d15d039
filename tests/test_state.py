"""Random states saved as tensors come back: the same draws, also through a weights-only load."""

import io
import random

import numpy as np
import torch

from bigbatch.state import rng_state, set_rng_state


def draws():
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),
        torch.rand(3).tolist(),
    )


def test_a_restored_state_repeats_every_generators_draws():
    random.gauss(0, 1)  # Python and numpy keep the second of each pair of normal draws:
    np.random.randn()  # the state holds it too
    state = rng_state()
    first = draws()
    set_rng_state(state)
    assert draws() == first


def test_the_state_loads_with_weights_only():
    state = rng_state()
    first = draws()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True))
    assert draws() == first

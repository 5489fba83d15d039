"""Fixtures of the experiment tests."""

import pytest

from bigbatch.experiments import runner

from .fake_runs import fake_train


@pytest.fixture
def trained(monkeypatch):
    """Training replaced by the fake of ``fake_runs``; the list of every config it trained."""
    calls = []

    def train(config, out, **options):
        calls.append(config)
        return fake_train(config, out, **options)

    monkeypatch.setattr(runner, "train", train)
    return calls

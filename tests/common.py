"""Helpers that test modules of more than one test package share."""

from bigbatch.testing import host_syncs


def count_syncs(fn):
    """Host synchronisations ``fn`` makes (``bigbatch.testing.host_syncs``)."""
    with host_syncs() as syncs:
        fn()
    return syncs.count

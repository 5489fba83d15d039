"""Plugins for training frameworks (optional imports: each needs its framework installed).

- :mod:`bigbatch.integrations.lightning`: a Lightning ``Callback`` (extra ``lightning``).
"""

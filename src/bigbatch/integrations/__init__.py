"""Plugins for training frameworks, each needing its extra: ``lightning``, ``hf``
(``Trainer``), ``deepspeed`` (ZeRO 0-2) and ``flower``."""

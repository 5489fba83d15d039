"""Plugins for training frameworks (optional imports: each needs its framework installed).

- :mod:`bigbatch.integrations.lightning`: a Lightning ``Callback`` (extra ``lightning``);
- :mod:`bigbatch.integrations.hf`: a Hugging Face ``Trainer`` and its callback (extra ``hf``);
- :mod:`bigbatch.integrations.deepspeed`: the plain loop around a DeepSpeed engine, ZeRO
  stages 0-2 (extra ``deepspeed``).
"""

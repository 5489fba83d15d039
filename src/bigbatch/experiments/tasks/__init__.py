"""Built-in tasks: small real problems that train on a CPU in minutes, no downloads.

- ``mnist1d``: MNIST-1D (Greydanus 2020) generated locally by the ``mnist1d``
  package (40k train / 10k test), cached on disk after the first build; a
  small 1-D CNN. The default task.
- ``teacher``: a teacher–student problem: inputs from N(0, I), labels from a
  fixed random teacher network of the student's own shape, so 100% is
  reachable; as many samples as asked for.
- ``digits``: scikit-learn's 8×8 digits (1797 images), cached on disk after the
  first read (importing scikit-learn takes a second), an MLP.
- ``lm``: next-token prediction on a synthetic language, an order-1 Markov
  chain with a known entropy rate (the loss floor), by a small transformer
  that logs its maximum attention logit (what MERIT bounds).
- ``text``: a byte-level GPT on real text: the Python sources of the
  installed ``torch`` package, read at run time, a fixed tenth of the files
  held out; validation loss in nats per byte.
"""

from __future__ import annotations

from .data import byte_windows, digits_arrays, markov_language, mnist1d_arrays, text_corpus
from .models import TinyTransformer
from .problem import Problem, Task
from .registry import TASKS

__all__ = [
    "TASKS",
    "Problem",
    "Task",
    "TinyTransformer",
    "byte_windows",
    "digits_arrays",
    "markov_language",
    "mnist1d_arrays",
    "text_corpus",
]

"""Warnings that point at the user's line, however deep inside bigbatch they are raised."""

from __future__ import annotations

import os
import sys
import warnings

import torch

#: frames in these folders are skipped: bigbatch's own, and torch's (its ``no_grad`` and
#: ``_disable_dynamo`` wrappers sit between a step and the code that warns)
_INTERNAL = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` located at the first frame outside bigbatch and torch (Python
    3.12's ``skip_file_prefixes``, for 3.10)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)

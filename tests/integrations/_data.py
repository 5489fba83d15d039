"""Data shared by the framework tests: a small teacher-student classification set."""

import torch
from torch.utils.data import Dataset


class Teacher(Dataset):
    """``n`` points in 16 dimensions, labels from a random linear teacher over 4 classes,
    as the dicts (``x``, ``labels``) the Hugging Face Trainer hands to a model."""

    def __init__(self, n=4096, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = (self.x @ torch.randn(16, 4, generator=gen)).argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}

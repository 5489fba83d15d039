"""Adaptive batching in a PyTorch Lightning run: one callback and bigbatch's sampler.

    python examples/lightning_callback.py        # needs: pip install "bigbatch[lightning]"

The teacher-student task of ``plain_loop.py`` in a ``LightningModule``; the
lines marked ``# bigbatch`` are what adaptive batching adds. Prints the batch
size as the controller changes it; about a minute on 2 CPU cores.
"""

import warnings

import lightning.pytorch as pl
import torch
from plain_loop import teacher_student
from torch import nn
from torch.utils.data import DataLoader

import bigbatch as bb
from bigbatch.integrations.lightning import AdaptiveBatchCallback

MICRO_BATCHES = 4
BUDGET = 1_000_000  # samples, not steps: the batch changes


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return bb.optim.LAMB(bb.optim.param_groups(self.net, weight_decay=0.01), lr=2e-3)


class PrintBatch(pl.Callback):
    def __init__(self, adaptive: AdaptiveBatchCallback):
        self.adaptive = adaptive

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        history = self.adaptive.history
        if (batch_idx + 1) % MICRO_BATCHES == 0 and len(history) % 40 == 1:
            m = history[-1]
            print(
                f"step {m['step']:5d}  samples {m['samples']:8d}  batch {m['batch_size']:5d} -> "
                f"{m['next_batch_size']:5d}  similarity {m['similarity']:+.3f}  "
                f"loss {m['loss']:.3f}"
            )


def main() -> None:
    torch.manual_seed(0)
    data = teacher_student(n=55_000)
    train, test = torch.utils.data.random_split(data, [50_000, 5_000])
    sampler = bb.batch.GlobalBatchSampler(  # bigbatch
        len(train), 32, micro_batches=MICRO_BATCHES, max_samples=BUDGET
    )
    adaptive = AdaptiveBatchCallback(  # bigbatch
        sampler,
        bb.batch.SimiGrad(target=1 / 3, initial=32, min=16, max=8192),
        schedule=bb.schedules.warmup_cosine(total=BUDGET, warmup=50_000),
    )
    trainer = pl.Trainer(
        accumulate_grad_batches=MICRO_BATCHES,  # bigbatch: = micro_batches
        use_distributed_sampler=False,  # bigbatch: the sampler shards itself
        max_epochs=1,  # bigbatch: the sampler ends at the sample budget
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[adaptive, PrintBatch(adaptive)],
    )
    model = Classifier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, DataLoader(train, batch_sampler=sampler))  # bigbatch: batch_sampler
    with torch.no_grad():
        x, y = data.tensors[0][test.indices], data.tensors[1][test.indices]
        accuracy = (model.net(x).argmax(1) == y).float().mean().item()
    steps = len(adaptive.history)
    print(
        f"{steps} steps, average batch {adaptive.samples / steps:.0f}, test accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main()

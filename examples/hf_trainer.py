"""Adaptive batching in a Hugging Face Trainer run, with a tiny GPT-2 built from a config.

    python examples/hf_trainer.py        # needs: pip install "bigbatch[hf]"

No downloads: the model is ``GPT2LMHeadModel(GPT2Config(...))`` with 2 layers
and the text a synthetic order-1 Markov language over 64 tokens (its entropy
rate is the best loss any model can reach). The lines marked ``# bigbatch``
are what adaptive batching adds. Prints the batch size as the controller
changes it; about a minute on 2 CPU cores.
"""

import math
import warnings

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import bigbatch as bb
from bigbatch.integrations.hf import AdaptiveBatchTrainer

VOCAB, CONTEXT, MICRO_BATCHES, BUDGET = 64, 32, 4, 60_000


class Markov(Dataset):
    """Sequences from a fixed random Markov chain; ``floor`` is the best possible loss.

    Each sequence starts from a uniform state, so the floor is the conditional
    entropy of the next token averaged over the positions' actual marginals.
    """

    def __init__(self, n: int = 100_000, seed: int = 0):  # more than the budget: no repeats
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(VOCAB, VOCAB, generator=gen) * 2.0
        self.transition = logits.softmax(-1)
        states = torch.randint(VOCAB, (n,), generator=gen)
        tokens = [states]
        for _ in range(CONTEXT - 1):
            states = torch.multinomial(self.transition[states], 1, generator=gen).squeeze(1)
            tokens.append(states)
        self.tokens = torch.stack(tokens, 1)
        p = self.transition
        row_entropy = -(p * p.log()).sum(1)
        marginal, floors = torch.full((VOCAB,), 1 / VOCAB), []
        for _ in range(CONTEXT - 1):  # position t predicts token t + 1 from token t
            floors.append(float(marginal @ row_entropy))
            marginal = marginal @ p
        self.floor = sum(floors) / len(floors)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class PrintBatch(TrainerCallback):
    def __init__(self, adaptive):
        self.adaptive = adaptive

    def on_step_end(self, args, state, control, **kwargs):
        history = self.adaptive.history
        if len(history) % 20 == 1:
            m = history[-1]
            print(
                f"step {m['step']:4d}  samples {m['samples']:7d}  batch {m['batch_size']:5d} -> "
                f"{m['next_batch_size']:5d}  similarity {m['similarity']:+.3f}  "
                f"loss {m['loss']:.3f}"
            )


def main() -> None:
    data = Markov()
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    sampler = bb.batch.GlobalBatchSampler(  # bigbatch
        len(data), 32, micro_batches=MICRO_BATCHES, max_samples=BUDGET
    )
    args = TrainingArguments(
        output_dir="runs/hf-example",
        gradient_accumulation_steps=MICRO_BATCHES,  # bigbatch: = micro_batches
        learning_rate=2e-3,
        weight_decay=0.01,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = AdaptiveBatchTrainer(  # bigbatch: the Trainer that can change the batch
        model=model,
        args=args,
        train_dataset=data,
        sampler=sampler,  # bigbatch
        controller=bb.batch.SimiGrad(target=1 / 3, initial=32, min=16, max=1024),  # bigbatch
        schedule=bb.schedules.warmup_cosine(total=BUDGET, warmup=3_000),  # bigbatch: in samples
    )
    trainer.add_callback(PrintBatch(trainer.bigbatch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    history = trainer.bigbatch.history
    # the Trainer divides by all 32 label tokens, the causal loss sums over 31 predictions
    final = sum(h["loss"] for h in history[-10:]) / 10 * CONTEXT / (CONTEXT - 1)
    print(
        f"{len(history)} steps, average batch {trainer.bigbatch.samples / len(history):.0f}, "
        f"final loss per predicted token {final:.3f} (floor {data.floor:.3f}, "
        f"uniform {math.log(VOCAB):.3f})"
    )


if __name__ == "__main__":
    main()

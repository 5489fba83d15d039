"""A program the Hugging Face tests run on every rank of a gloo cluster (importable by
spawned ranks), and in the test's own process as the one-process reference."""

import os
import warnings

import torch
import torch.distributed as dist
import transformers

import bigbatch as bb
from bigbatch.integrations.hf import AdaptiveBatchTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=256, length=12):
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 32, (n, length), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i].clone()}


def tiny_llama() -> transformers.LlamaForCausalLM:
    """A one-layer Llama over 32 tokens: a loss that takes ``num_items_in_batch``."""
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def causal_lm_statistics(out: str, micro_batches: int, steps: int = 4) -> dict:
    """A tiny Llama (its loss takes ``num_items_in_batch``) trained at a constant batch of
    32: each step's engine loss weights summed on this rank, and the step's statistics."""
    if dist.is_initialized():  # the Trainer learns its world as torchrun tells it
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # (joined already)
    torch.manual_seed(0)
    model = tiny_llama()
    sampler = bb.batch.GlobalBatchSampler(
        256, 32, micro_batches=micro_batches, max_samples=32 * steps
    )
    arguments = transformers.TrainingArguments(
        output_dir=out, gradient_accumulation_steps=micro_batches, learning_rate=1e-2, optim="sgd",
        weight_decay=0.0, max_grad_norm=0.0, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = AdaptiveBatchTrainer(
        model=model, args=arguments, train_dataset=Tokens(),
        sampler=sampler, controller=bb.batch.Constant(32), statistics=True,
        lr_scaling="none",
    )  # fmt: skip
    weights, draw = [], trainer.get_batch_samples

    def recorded(*args):
        batches, count = draw(*args)
        if batches:
            weights.append(sum(trainer.bigbatch.loss_weights))
        return batches, count

    trainer.get_batch_samples = recorded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    history = trainer.bigbatch.history
    return {
        "weights": weights,
        "grad_sq_norm": [h["grad_sq_norm"] for h in history],
        "trace": [h["trace"] for h in history],
    }

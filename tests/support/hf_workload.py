"""A Hugging Face causal LM as a user workload, referenced as "tests.support.hf_workload:TinyCausalLM".

The model is a ``transformers`` GPT-2 built from its config (tied embedding / lm head, dropout 0.1 at
its defaults), the data a ``datasets.Dataset`` held in memory, batches dicts of ``input_ids`` and
``attention_mask``. Run it with::

    raylastic train --set workload.name=tests.support.hf_workload:TinyCausalLM --set strategy.name=zero2

Example::

    workload = TinyCausalLM()
    model = workload.build_model()
    batch = workload.train_dataset()[:4]              # {"input_ids": int64[4, 16], "attention_mask": ...}
    loss = workload.training_step(model, batch)        # ~ln(vocab_size) at init
"""

from __future__ import annotations

import datasets
import torch
import transformers

from raylastic.workloads.huggingface_parallel import parallelize_huggingface

STRIDES = (1, 2, 3)


class TinyCausalLM:
    """Next-token prediction over arithmetic progressions ``(start + stride * t) % vocab_size``.

    A row's start and stride (1, 2 or 3) are drawn from a fixed seed, so every process builds the
    same rows. The first token says nothing (loss ln(vocab_size)); after that a bigram model reaches
    ln(3) and one that reads the stride off the previous two tokens reaches 0.
    """

    def __init__(self, *, vocab_size: int = 64, seq_len: int = 16, num_train: int = 512, num_eval: int = 64,
                 n_layer: int = 2, n_embd: int = 32, n_head: int = 2, weight_decay: float = 0.1,
                 attn_implementation: str = "eager") -> None:
        if seq_len > 32:
            raise ValueError(f"workload.options.seq_len must be <= 32 (the model's n_positions), got {seq_len}")
        self.config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=32, n_layer=n_layer, n_embd=n_embd,
                                              n_head=n_head, bos_token_id=0, eos_token_id=0,
                                              attn_implementation=attn_implementation)
        self.weight_decay = weight_decay
        rows = _progressions(num_train + num_eval, vocab_size=vocab_size, seq_len=seq_len)
        self._train, self._eval = _as_dataset(rows[:num_train]), _as_dataset(rows[num_train:])

    def build_model(self) -> torch.nn.Module:
        """A fresh GPT-2 from the config, initialised from the process's torch seed."""
        return transformers.GPT2LMHeadModel(self.config)

    def train_dataset(self) -> datasets.Dataset:
        return self._train

    def training_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's mean next-token loss (labels are the inputs; the model shifts them)."""
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["input_ids"]).loss

    def configure_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW with weight decay on the matrices (and the tied embedding) only, not on biases and LayerNorms."""
        params = list(model.parameters())  # the tied embedding / lm head is listed once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}])

    def eval_dataset(self) -> datasets.Dataset:
        """Held-out rows (different starts and strides from the same generator)."""
        return self._eval

    def eval_step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The summed loss of the batch's samples (all rows have the same length, so mean * count)."""
        loss = self.training_step(model, batch)
        return {"eval_loss": loss * batch["input_ids"].shape[0]}


class TinyLlama(TinyCausalLM):
    """The same data with a Llama built from its config (grouped-query attention, RMSNorm, SwiGLU, no
    dropout), split by its own tensor-parallel plan under ``parallel.tp``."""

    def __init__(self, *, vocab_size: int = 64, seq_len: int = 16, num_train: int = 512, num_eval: int = 64,
                 n_layer: int = 2, n_embd: int = 32, n_head: int = 4, n_kv_head: int = 2) -> None:
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, num_train=num_train, num_eval=num_eval)
        self.config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=2 * n_embd,
                                               num_hidden_layers=n_layer, num_attention_heads=n_head,
                                               num_key_value_heads=n_kv_head, max_position_embeddings=32)

    def build_model(self) -> torch.nn.Module:
        return transformers.LlamaForCausalLM(self.config)

    def parallelize(self, model: torch.nn.Module, tp_mesh) -> None:
        parallelize_huggingface(model, tp_mesh)


def _progressions(count: int, *, vocab_size: int, seq_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, vocab_size, (count, 1), generator=generator)
    strides = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (count, 1), generator=generator)]
    return (starts + strides * torch.arange(seq_len)) % vocab_size


def _as_dataset(rows: torch.Tensor) -> datasets.Dataset:
    columns = {"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()}
    return datasets.Dataset.from_dict(columns).with_format("torch")

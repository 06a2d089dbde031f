"""The GPT recipe: nanoGPT's model with dropout, trained on a token directory made by ``raylastic tokenize``.

Unlike ``chargpt`` (a corpus held in memory), the data is read from memory-mapped ``.bin`` files
(``workloads.tokens.TokenBlocks``), so it can be larger than RAM and DataLoader workers stay small::

    raylastic tokenize data/stdlib --stdlib
    raylastic train --set workload.name=gpt --set workload.options.data_dir=$PWD/data/stdlib

``data_dir`` is opened in every worker process, so on a cluster give a path every node can read.
The optimizer follows nanoGPT's ``configure_optimizers``: AdamW, betas (0.9, 0.95), weight decay on
the matrices and embeddings (parameters of 2 or more dimensions) only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Subset

from raylastic.workloads.chargpt import GPT
from raylastic.workloads.gpt_splits import GPTSplits
from raylastic.workloads.token_checks import DTYPES, TokenFileError
from raylastic.workloads.tokens import TokenBlocks, stacked

TOKENIZE_HINT = "make one with `raylastic tokenize DIR --stdlib` (or your own text files instead of --stdlib)"


class TokenGPT(GPTSplits):
    """Next-token prediction over a tokenized corpus with a GPT (tied embedding / lm head, dropout).

    Options (``workload.options``):
        data_dir: directory holding train.bin, val.bin and meta.json from ``raylastic tokenize``.
        n_layer, n_head, n_embd, block_size: model shape; ``n_embd`` must be divisible by ``n_head``.
        dropout: dropout probability in [0, 1) (embeddings, attention, residual branches).
        weight_decay: AdamW weight decay (>= 0) of the 2-D and larger parameters.
        eval_blocks: at most this many leading val.bin windows are scored by the distributed evaluation.
        tie_embeddings: the lm head is the token embedding (default), or a matrix of its own (pipeline stages).

    Samples are non-overlapping ``block_size`` windows of train.bin with their next-token targets.
    The defaults (4 layers, 4 heads, width 256, context 256) give 3.3 M parameters with bytes.

    Example::

        workload = TokenGPT(data_dir="data/stdlib", n_layer=1, n_embd=32, block_size=16)
        model = workload.build_model()
        loss = workload.training_step(model, workload.train_dataset().__getitems__([0, 1]))  # ~ln(256) at init
    """

    def __init__(self, *, data_dir: str | None = None, n_layer: int = 4, n_head: int = 4, n_embd: int = 256,
                 block_size: int = 256, dropout: float = 0.1, weight_decay: float = 0.1, eval_blocks: int = 256,
                 tie_embeddings: bool = True):
        for option, value in [("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                              ("block_size", block_size), ("eval_blocks", eval_blocks)]:
            _require(_is_int(value) and value > 0, option, "a positive int", value)
        _require(n_embd % n_head == 0, "n_embd", f"divisible by n_head={n_head}", n_embd)
        _require(_is_number(dropout) and 0.0 <= dropout < 1.0, "dropout", "a float in [0, 1)", dropout)
        _require(_is_number(weight_decay) and weight_decay >= 0.0, "weight_decay", "a float >= 0", weight_decay)
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        _require(isinstance(tie_embeddings, bool), "tie_embeddings", "true or false", tie_embeddings)
        self.dropout, self.weight_decay, self.eval_blocks = float(dropout), float(weight_decay), eval_blocks
        self.tie_embeddings = tie_embeddings
        self.data_dir = _token_dir(data_dir)
        self.meta = _read_meta(self.data_dir)
        self.vocab_size = self.meta["vocab_size"]
        self._train = self._blocks("train.bin")
        self._val = self._blocks("val.bin")

    def build_model(self) -> torch.nn.Module:
        """A fresh GPT, initialised (normal, std 0.02) from the process's torch seed."""
        return GPT(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, block_size=self.block_size,
                   vocab_size=self.vocab_size, dropout=self.dropout, tie_embeddings=self.tie_embeddings)

    def train_dataset(self) -> TokenBlocks:
        """train.bin's windows: inputs and next-token targets, both ``int64[block_size]``."""
        return self._train

    def collate(self, samples) -> tuple[torch.Tensor, torch.Tensor]:
        """``TokenBlocks.__getitems__`` already batches: its ``(inputs, targets)`` pass through."""
        return stacked(samples)

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy over the batch's tokens (every sample has block_size of them)."""
        inputs, targets = batch
        return self.pipeline_loss(model(inputs), targets)

    def configure_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW with ``weight_decay`` on parameters of 2+ dimensions and none on biases and LayerNorms."""
        params = [p for p in model.parameters() if p.requires_grad]  # a tied weight is listed once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], betas=(0.9, 0.95))

    def eval_dataset(self) -> Subset:
        """The first ``eval_blocks`` windows of val.bin (fetched a batch at a time, as training's are)."""
        return Subset(self._val, range(min(self.eval_blocks, len(self._val))))

    def eval_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums over the batch's samples of each one's mean token ``eval_loss`` (and ``bits_per_byte``
        for the byte tokenizer); Raylastic divides them by the number of samples evaluated."""
        inputs, targets = batch
        with torch.no_grad():
            logits = model(inputs)
            token_losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        loss_sum = token_losses.view(targets.shape).mean(dim=1).sum()
        metrics = {"eval_loss": loss_sum}
        if self.meta.get("tokenizer") == "bytes":
            metrics["bits_per_byte"] = loss_sum / math.log(2)
        return metrics

    def _blocks(self, name: str) -> TokenBlocks:
        path = self.data_dir / name
        if not path.is_file():
            raise ValueError(f"workload.options.data_dir={str(self.data_dir)!r} has no {name}; {TOKENIZE_HINT}")
        try:
            return TokenBlocks(path, self.block_size, self.meta["dtype"], vocab_size=self.vocab_size)
        except TokenFileError as error:
            raise ValueError(f"workload.options.data_dir={str(self.data_dir)!r} holds a {name} that does not match "
                             f"its meta.json (dtype {self.meta['dtype']}, vocab_size {self.vocab_size}): "
                             f"{error}") from error
        except ValueError as error:
            raise ValueError(f"workload.options.block_size={self.block_size} does not fit "
                             f"workload.options.data_dir={str(self.data_dir)!r}: {error}") from error


def _token_dir(data_dir: str | os.PathLike | None) -> Path:
    if data_dir is None:
        raise ValueError(f"workload.options.data_dir is required: a directory of train.bin, val.bin and meta.json; "
                         f"{TOKENIZE_HINT}")
    _require(isinstance(data_dir, (str, os.PathLike)) and bool(str(data_dir)), "data_dir", "a directory path",
             data_dir)
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise ValueError(f"workload.options.data_dir={data_dir!r} is not a directory; {TOKENIZE_HINT}")
    return path


def _read_meta(data_dir: Path) -> dict:
    path = data_dir / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"workload.options.data_dir={str(data_dir)!r} has no meta.json; {TOKENIZE_HINT}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"workload.options.data_dir={str(data_dir)!r}: cannot read meta.json ({error})") from error
    if not (isinstance(meta, dict) and _is_int(meta.get("vocab_size")) and meta["vocab_size"] > 0
            and meta.get("dtype") in DTYPES):
        raise ValueError(f"workload.options.data_dir={str(data_dir)!r}: meta.json must hold a positive int "
                         f"vocab_size and a dtype in {', '.join(DTYPES)}, got {meta!r}")
    ids = int(np.iinfo(DTYPES[meta["dtype"]]).max) + 1
    if meta["vocab_size"] > ids:
        raise ValueError(f"workload.options.data_dir={str(data_dir)!r}: meta.json's vocab_size {meta['vocab_size']} "
                         f"does not fit its dtype {meta['dtype']} (ids below {ids}); token files of that vocabulary "
                         "are uint32")
    return meta


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, option: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"workload.options.{option} must be {expected}, got {value!r}")

"""A small byte-level GPT trained on the Python standard library's own source code.

The corpus needs no download and no vocabulary file: it is the top-level ``.py`` files of
``sysconfig.get_paths()["stdlib"]`` read in name order, encoded as UTF-8 bytes (vocabulary 256),
so every machine running the same Python build holds the same data. Try it::

    python -c "from raylastic.workloads.chargpt import CharGPT; print(CharGPT.num_parameters(8, 8, 720, 64))"

The model follows nanoGPT (https://github.com/karpathy/nanoGPT): token + position embeddings,
pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm and an lm head
tied to the token embedding. CharGPT uses no dropout, so its ``forward`` is deterministic
(``workloads.gpt.TokenGPT`` reuses the model with dropout and its own vocabulary).
"""

from __future__ import annotations

import math
import os
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from raylastic.workloads.gpt_splits import GPTSplits

VOCAB_SIZE = 256  # one token per byte
EVAL_WINDOWS = 64  # held-out windows in ``eval_dataset``


def load_stdlib_corpus(num_chars: int) -> bytes:
    """The first ``num_chars`` characters of the stdlib's top-level ``.py`` files (sorted by name), as UTF-8."""
    stdlib = sysconfig.get_paths()["stdlib"]
    pieces, collected = [], 0
    for name in sorted(os.listdir(stdlib)):
        path = os.path.join(stdlib, name)
        if not name.endswith(".py") or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:  # bytes, so no platform newline translation
            text = f.read().decode("utf-8", errors="replace")
        pieces.append(text[: num_chars - collected])
        collected += len(pieces[-1])
        if collected == num_chars:
            return "".join(pieces).encode("utf-8")
    raise ValueError(f"workload.options.corpus_chars={num_chars} exceeds the {collected} characters "
                     f"of the top-level .py files in {stdlib}")


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.dropout = dropout
        # Separate projections, not one fused [q; k; v]: tensor parallelism splits each by heads (its rows).
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time = x.shape[:2]
        # -1 heads: all of them, or this rank's under tensor parallelism
        q, k, v = (projection(x).view(batch, time, -1, self.head_dim).transpose(1, 2)
                   for projection in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, -1)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.mlp_dropout = nn.Dropout(dropout)  # outside ``mlp``, whose last module is the projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """GPT over ``vocab_size`` tokens (bytes by default); ``forward(idx: int64[B, T])`` returns logits
    ``[B, T, vocab_size]`` for T <= block_size.

    ``dropout`` (nanoGPT's places: embeddings, attention weights, both residual branches) is active only
    in train mode; at the default 0.0 ``forward`` is deterministic and draws no random numbers.
    ``tie_embeddings``: the lm head is the token embedding (GPT-2's tying), or a matrix of its own.

    A pipeline stage (``workloads/gpt_pipeline.py``) is a GPT with some parts set to None: without the
    embeddings its ``forward`` takes the residual stream ``[B, T, n_embd]`` instead of token ids, and without
    the head it returns the residual stream.
    """

    def __init__(self, *, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int = VOCAB_SIZE,
                 dropout: float = 0.0, tie_embeddings: bool = True):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        # A ModuleDict ("0", "1", ...): the parameter names of a ModuleList, and a pipeline stage can drop blocks
        # without renumbering the rest.
        self.blocks = nn.ModuleDict({str(index): Block(n_embd, n_head, dropout) for index in range(n_layer)})
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)
        for block in self.blocks.values():  # GPT-2's scaled init of the projections into the residual stream
            for proj in (block.attn.proj, block.mlp[-1]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx if self.wte is None else self._embed(idx)
        for block in self.blocks.values():
            x = block(x)
        return x if self.lm_head is None else self.lm_head(self.ln_f(x))

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        time = idx.shape[1]
        if time > self.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size {self.block_size}")
        return self.drop(self.wte(idx) + self.wpe(torch.arange(time, device=idx.device)))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CharGPT(GPTSplits):
    """Next-byte prediction on stdlib source with a small GPT (tied embedding / lm head, no dropout).

    Options (``workload.options``):
        n_layer, n_head, n_embd, block_size: model shape; ``n_embd`` must be divisible by ``n_head``.
        corpus_chars: characters of stdlib source to use (the default is ~400 KB).
        test_fraction: trailing share of the corpus held out for ``eval_dataset``, in (0, 1).
        tie_embeddings: the lm head is the token embedding (default), or a matrix of its own (pipeline stages).

    Training samples are non-overlapping windows of ``block_size + 1`` bytes from the leading
    ``1 - test_fraction`` of the corpus; input is the first ``block_size`` bytes, target the last.
    The defaults give 120,576 parameters. For a model big enough to shard (ZeRO benchmarks),
    ``n_layer=8, n_head=8, n_embd=720, block_size=64`` gives exactly 50,073,120 parameters.

    Example::

        workload = CharGPT(n_layer=1, n_embd=32)
        loss = workload.training_step(workload.build_model(), workload.train_dataset()[:4])  # ~ln(256) at init
    """

    def __init__(self, *, n_layer: int = 2, n_head: int = 2, n_embd: int = 64, block_size: int = 64,
                 corpus_chars: int = 400_000, test_fraction: float = 0.1, tie_embeddings: bool = True):
        for option, value in [("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                              ("block_size", block_size), ("corpus_chars", corpus_chars)]:
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"workload.options.{option} must be a positive int, got {value!r}")
        if n_embd % n_head:
            raise ValueError(f"workload.options.n_embd={n_embd} must be divisible by n_head={n_head}")
        if not (isinstance(test_fraction, (int, float)) and not isinstance(test_fraction, bool)
                and 0.0 < test_fraction < 1.0):
            raise ValueError(f"workload.options.test_fraction must be a float in (0, 1), got {test_fraction!r}")
        if not isinstance(tie_embeddings, bool):
            raise ValueError(f"workload.options.tie_embeddings must be true or false, got {tie_embeddings!r}")
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        self.tie_embeddings = tie_embeddings

        corpus = torch.frombuffer(bytearray(load_stdlib_corpus(corpus_chars)), dtype=torch.uint8)
        split = int(len(corpus) * (1.0 - test_fraction))
        train_windows = _windows(corpus[:split], block_size + 1)
        self._inputs, self._targets = train_windows[:, :-1].contiguous(), train_windows[:, 1:].contiguous()
        self._eval_windows = _windows(corpus[split:], block_size + 1)[:EVAL_WINDOWS]
        if len(train_windows) == 0 or len(self._eval_windows) == 0:
            raise ValueError(f"workload.options.corpus_chars={corpus_chars} with test_fraction={test_fraction} "
                             f"leaves no {block_size + 1}-byte window for training or evaluation")

    @staticmethod
    def num_parameters(n_layer: int, n_head: int, n_embd: int, block_size: int) -> int:
        """Parameter count of ``build_model()`` for this shape (``n_head`` does not change it)."""
        per_block = 12 * n_embd * n_embd + 13 * n_embd  # q, k, v, proj, 4x MLP with biases, two LayerNorms
        return (VOCAB_SIZE + block_size) * n_embd + n_layer * per_block + 2 * n_embd  # + final LayerNorm

    def build_model(self) -> torch.nn.Module:
        """A fresh GPT, initialised (normal, std 0.02) from the process's torch seed."""
        return GPT(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, block_size=self.block_size,
                   tie_embeddings=self.tie_embeddings)

    def train_dataset(self) -> TensorDataset:
        """Inputs and next-byte targets, both ``int64[N, block_size]``."""
        return TensorDataset(self._inputs, self._targets)

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-byte cross-entropy over the batch's tokens (every sample has block_size of them)."""
        inputs, targets = batch
        return self.pipeline_loss(model(inputs), targets)

    def eval_dataset(self) -> TensorDataset:
        """Up to 64 held-out windows: inputs and next-byte targets, both ``int64[N, block_size]``."""
        return TensorDataset(self._eval_windows[:, :-1], self._eval_windows[:, 1:])

    def eval_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums over the batch's windows of each one's mean next-byte ``eval_loss`` and ``bits_per_byte``; Raylastic
        spreads the windows over the ranks (through a pipeline too) and divides by the number evaluated."""
        inputs, targets = batch
        logits = model(inputs)
        token_losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        loss_sum = token_losses.view(targets.shape).mean(dim=1).sum()
        return {"eval_loss": loss_sum, "bits_per_byte": loss_sum / math.log(2)}


def _windows(data: torch.Tensor, length: int) -> torch.Tensor:
    """``data`` cut into consecutive non-overlapping rows of ``length``, as int64; the tail is dropped."""
    rows = len(data) // length
    return data[: rows * length].view(rows, length).long()

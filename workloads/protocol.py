"""What a workload is: a model, its data, a training step, and (optionally) how to evaluate it.

A workload is a class referenced by import path, ``"pkg.module:ClassName"`` (or a built-in
short name such as ``"digits"``); Raylastic constructs it as ``ClassName(**options)`` with
``workload.options`` from the job config, once in every worker process. It owns the loop (that is
what lets it discard a failed step, hand state over and keep the data order); the workload says
what one batch costs.

Example (a Hugging Face model with dict batches, run with ``--set workload.name=mypkg.lm:TinyLM``)::

    class TinyLM:
        def build_model(self):
            return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2))

        def train_dataset(self):                 # any map-style dataset; here memory-mapped Arrow
            return datasets.load_from_disk("data/train").with_format("torch")

        def training_step(self, model, batch):   # batch: what collate made, on the worker's device
            return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

        def configure_optimizer(self, model):    # optional: param groups (lr comes from optim.lr)
            decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
            no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
            return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": no_decay, "weight_decay": 0.0}])

Required:
- ``build_model()``: deterministic given the process's torch seed (the worker seeds it).
- ``train_dataset()``: a map-style dataset (``__len__`` and ``__getitem__``; ``__getitems__`` is used
  when it has one, as Hugging Face ``datasets`` do). Step k's samples come from a seeded order that
  does not depend on the world size.
- ``training_step(model, batch) -> Tensor``: the **mean** loss over the batch's samples (what
  ``F.cross_entropy`` and Hugging Face models return). Raylastic weights it by the batch's sample
  count, so a step's gradient is the mean over the global batch at any world size and micro-batch
  size. ``batch`` is what ``collate`` made (a tensor, tuple, dict, nested), its tensors on the device.

Optional:
- ``collate(samples: list) -> batch``; default: torch's ``default_collate`` (a ``TensorDataset``
  is gathered in one indexing per batch instead).
- ``configure_optimizer(model) -> torch.optim.Optimizer``: any torch optimizer, param groups allowed.
  ``optim.lr`` and ``optim.schedule`` set every group's lr each step (times a group's ``lr_scale``,
  default 1). zero1/zero2/zero3 shard optimizer state by rows, so they take only element-wise
  optimizers (Adam, AdamW, SGD, ...); anything else is refused with an error naming them.
- ``evaluate(model) -> dict[str, float]``: held-out metrics (numbers, or one-element tensors), run on every
  rank (under zero3 its forward passes are collective); a classifier returns ``"accuracy"``. Compare outputs
  with targets on the output's device: under ``strategy.offload`` the parameters wait on the CPU while
  forward runs on the GPU.
- ``parallelize(model, tp_mesh)``: required for ``parallel.tp > 1``. Split ``model`` in place over the
  ranks of ``tp_mesh`` (a 1-D DeviceMesh), e.g. with torch's ``parallelize_module`` and a plan of
  ``ColwiseParallel``/``RowwiseParallel`` styles (workloads/gpt_parallel.py is the built-in GPT's). Every
  rank of the tp group gets the same batches. A loss on logits left split by class (a colwise head with
  ``use_local_output=False``) works: forward and backward run under ``loss_parallel``.
- ``model_limits(model) -> {"blocks": int, "tp_degrees": [int]}``: how far ``model`` splits (the most
  pipeline stages, the tp degrees ``parallelize`` takes), called once on the model built on the meta device. With
  it, a re-plan after a loss may choose other degrees than parallel.tp and parallel.pp (parallel.degrees).
- ``eval_dataset()`` with ``eval_step(model, batch) -> dict[str, Tensor | float]``: evaluation spread
  over all ranks. ``eval_step`` returns *sums* over the batch's samples; Raylastic adds them up over
  batches and ranks and reports each divided by the number of samples evaluated.

Randomness in forward (dropout) is allowed: before each micro-batch every rank seeds torch's RNG
from the run seed, the step and the micro-batch's position in the global batch, so a run is
reproducible and a redone step draws the same masks. Without randomness in forward the result does
not depend on the world size or the micro-batch size; with it, masks follow the batch's split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: naming a workload that cannot be imported is reported without torch's import
    import torch
    from torch.utils.data import Dataset

REQUIRED_METHODS = ("build_model", "train_dataset", "training_step")


@runtime_checkable
class Workload(Protocol):
    def build_model(self) -> torch.nn.Module: ...

    def train_dataset(self) -> Dataset: ...

    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor: ...

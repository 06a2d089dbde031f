"""scikit-learn's 8x8 handwritten digits with a small MLP: the quick, always-available workload.

The data ships inside scikit-learn (no download): 1,797 images of 64 pixels, 10 classes. It is read
from that file without importing scikit-learn, whose import (~0.8 s, SciPy with it) would add to every
new worker's start-up. A default run trains in seconds on CPU and reaches over 95% held-out accuracy.
Try it::

    python -c "from raylastic.workloads import load_workload; print(load_workload('digits').train_dataset()[:2])"
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

NUM_FEATURES = 64
NUM_CLASSES = 10


class Digits:
    """Classify 8x8 digit images with a two-hidden-layer ReLU MLP (64 -> hidden -> hidden -> 10).

    Options (``workload.options``):
        hidden: width of both hidden layers.
        test_fraction: share of the 1,797 images held out for ``evaluate``, in (0, 1).
        split_seed: seed of the stratified train/test split; the split never depends on torch's RNG,
            so every worker holds the same data.

    Example::

        workload = Digits(hidden=64)
        model = workload.build_model()
        workload.training_step(model, workload.train_dataset()[:32]).backward()
    """

    def __init__(self, *, hidden: int = 128, test_fraction: float = 0.2, split_seed: int = 0):
        _require(_is_int(hidden) and hidden > 0, "hidden", "a positive int", hidden)
        _require(_is_fraction(test_fraction), "test_fraction", "a float in (0, 1)", test_fraction)
        _require(_is_int(split_seed) and split_seed >= 0, "split_seed", "a non-negative int", split_seed)
        self.hidden = hidden
        self.test_fraction = float(test_fraction)
        self.split_seed = split_seed

        features, labels = read_digits()
        train, test = stratified_split(labels, self.test_fraction, split_seed)
        self._x_train, self._y_train = torch.from_numpy(features[train]), torch.from_numpy(labels[train])
        self._x_test, self._y_test = torch.from_numpy(features[test]), torch.from_numpy(labels[test])

    def build_model(self) -> torch.nn.Module:
        """A fresh MLP, initialised from the process's torch seed."""
        return torch.nn.Sequential(
            torch.nn.Linear(NUM_FEATURES, self.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, self.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, NUM_CLASSES),
        )

    def train_dataset(self) -> TensorDataset:
        """Training images ``float32[N, 64]`` in [0, 1] and labels ``int64[N]``."""
        return TensorDataset(self._x_train, self._y_train)

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the batch of ``(images, labels)``."""
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out ``accuracy`` and mean cross-entropy ``eval_loss``; leaves the model's mode as it was."""
        x = self._x_test.to(next(model.parameters()).device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(x)
                y = self._y_test.to(logits.device)  # under strategy.offload the parameters wait on the CPU
                loss = F.cross_entropy(logits, y).item()
                accuracy = (logits.argmax(dim=1) == y).float().mean().item()
        finally:
            model.train(was_training)
        return {"accuracy": accuracy, "eval_loss": loss}


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images as ``float32[N, 64]`` in [0, 1] and their labels ``int64[N]``, from the CSV that
    scikit-learn's ``load_digits`` reads (64 pixel intensities 0..16, then the label, per row)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits workload reads its data from scikit-learn's package: "
                                  "pip install scikit-learn")
    rows = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz",
                      delimiter=",")
    return (rows[:, :-1] / 16.0).astype(np.float32), rows[:, -1].astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices, stratified: ceil(test_fraction * N) held out (as scikit-learn's
    train_test_split), every class within one sample of its proportional share of them. Which samples of a
    class are held out is drawn from ``seed`` alone: every process given the same seed makes the same split.

    Example::

        train, test = stratified_split(np.array([0, 0, 0, 0, 1, 1, 1, 1]), 0.25, seed=0)  # one of each class held out
    """
    n = len(labels)
    n_test = math.ceil(test_fraction * n)
    shuffled = np.random.default_rng(seed).permutation(n)
    by_class = shuffled[np.argsort(labels[shuffled], kind="stable")]  # grouped by class, shuffled within each
    position = np.arange(n)
    held_out = (position + 1) * n_test // n > position * n_test // n  # every (n / n_test)-th: spread evenly
    return np.sort(by_class[~held_out]), np.sort(by_class[held_out])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_fraction(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value < 1.0


def _require(ok: bool, option: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"workload.options.{option} must be {expected}, got {value!r}")

"""A user-defined workload outside the package, referenced as "tests.support.user_workload:Parity"."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from raylastic.workloads.chargpt import CharGPT
from raylastic.workloads.digits import Digits


class Parity:
    """Classify whether the sum of 8 random +-1 features is positive."""

    def __init__(self, num_samples: int = 512, hidden: int = 32) -> None:
        self.num_samples = num_samples
        self.hidden = hidden
        generator = torch.Generator().manual_seed(1234)
        self.inputs = torch.randint(0, 2, (num_samples + 128, 9), generator=generator).float() * 2 - 1
        self.targets = (self.inputs.sum(1) > 0).long()

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(9, self.hidden), torch.nn.Tanh(), torch.nn.Linear(self.hidden, 2))

    def train_dataset(self) -> TensorDataset:
        return TensorDataset(self.inputs[: self.num_samples], self.targets[: self.num_samples])

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        with torch.no_grad():
            predicted = model(self.inputs[self.num_samples:]).argmax(1)
        return {"accuracy": (predicted == self.targets[self.num_samples:]).float().mean().item()}


class SlowDigits:
    """The digits workload with a fixed pause per micro-batch, so a test can act while it trains."""

    def __init__(self, pause_s: float = 0.02) -> None:
        from raylastic.workloads.digits import Digits

        self.digits = Digits()
        self.pause_s = pause_s

    def build_model(self) -> torch.nn.Module:
        return self.digits.build_model()

    def train_dataset(self) -> TensorDataset:
        return self.digits.train_dataset()

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        import time

        time.sleep(self.pause_s)
        return self.digits.training_step(model, batch)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.digits.evaluate(model)


class SlowUntilGrown(SlowDigits):
    """SlowDigits that pauses ``growing_pause_s`` instead until its process has trained in a group of ``full``
    ranks: a run waiting for a worker to join gives it as many of those longer steps as it has left, however
    slowly the machine starts the worker, and runs at ``pause_s`` once it has grown."""

    def __init__(self, full: int = 3, pause_s: float = 0.4, growing_pause_s: float = 2.0) -> None:
        super().__init__(pause_s)
        self.full, self.growing_pause_s, self.grown = full, growing_pause_s, False

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.grown = self.grown or (dist.is_initialized() and dist.get_world_size() >= self.full)
        time.sleep(self.pause_s if self.grown else self.growing_pause_s)
        return self.digits.training_step(model, batch)


class DropoutDigits:
    """The digits MLP with dropout after each hidden layer: randomness in forward."""

    def __init__(self, p: float = 0.3) -> None:
        from raylastic.workloads.digits import Digits

        self.digits = Digits(hidden=64)
        self.p = p

    def build_model(self) -> torch.nn.Module:
        from raylastic.workloads.digits import NUM_CLASSES, NUM_FEATURES

        return torch.nn.Sequential(torch.nn.Linear(NUM_FEATURES, 64), torch.nn.ReLU(), torch.nn.Dropout(self.p),
                                   torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(self.p),
                                   torch.nn.Linear(64, NUM_CLASSES))

    def train_dataset(self) -> TensorDataset:
        return self.digits.train_dataset()

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.digits.training_step(model, batch)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.digits.evaluate(model)


class SmoothDigits(Digits):
    """The digits MLP with tanh for ReLU: no kink for another sum order's float noise to turn into a visible step,
    so a run whose ranks sum each gradient in other orders stays within float noise of one rank's training."""

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        return torch.nn.Sequential(*(torch.nn.Tanh() if isinstance(m, torch.nn.ReLU) else m for m in model))


def refuse_object_collectives() -> None:
    """Make torch's object collectives (which unpickle what a peer sent) raise in this process unless DCP calls
    them (its save and load plans travel as pickles, torch's own): a run whose workers call this shows that our
    code sends plain values only (strategies/plain_objects.py)."""
    import sys

    import torch.distributed.distributed_c10d as c10d

    def outside_dcp(original):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and "torch/distributed/checkpoint/" not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is None:
                raise AssertionError("a Python object was sent over a process group as a pickle")
            return original(*args, **kwargs)
        return call

    if not getattr(c10d._tensor_to_object, "refused", False):  # every *_object* collective goes through these two
        for name in ("_object_to_tensor", "_tensor_to_object"):
            refused = outside_dcp(getattr(c10d, name))
            refused.refused = True
            setattr(c10d, name, refused)


class PickleFreeDigits(Digits):
    """The digits workload in processes where torch's object collectives raise (``refuse_object_collectives``)."""

    def __init__(self) -> None:
        refuse_object_collectives()
        super().__init__()


class PickleFreeCharGPT(CharGPT):
    """chargpt (tp, pp) in processes where torch's object collectives raise (``refuse_object_collectives``)."""

    def __init__(self, **options) -> None:
        refuse_object_collectives()
        super().__init__(**options)


class CharGPTSlowWhileSmall(CharGPT):
    """chargpt whose pipeline's last stage pauses ``pause_s`` per micro-batch while its generation has fewer than
    ``full_world`` ranks, so that a test sees a run that shrank grow back before it ends, and ``full_pause_s`` at
    ``full_world`` or more, so that a notice or a drain lands mid-run (one process, no pipeline, or evaluation:
    no pause)."""

    def __init__(self, *, pause_s: float = 0.1, full_pause_s: float = 0.0, full_world: int = 4, **options) -> None:
        super().__init__(**options)
        self.pause_s, self.full_pause_s, self.full_world = pause_s, full_pause_s, full_world

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and torch.is_grad_enabled():
            time.sleep(self.pause_s if dist.get_world_size() < self.full_world else self.full_pause_s)
        return super().pipeline_loss(output, target)

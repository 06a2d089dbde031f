"""Built-in workloads (digits, chargpt) and the workload registry, single process, no Ray."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raylastic.actors.worker.evaluation import Evaluator
from raylastic.workloads import load_workload
from raylastic.workloads.chargpt import CharGPT
from raylastic.workloads.digits import Digits, read_digits, stratified_split
from raylastic.workloads.protocol import Workload

SMALL_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "corpus_chars": 50_000}


def _adam_steps(workload, model, steps: int, *, batch_size: int, lr: float) -> list[float]:
    """Plain single-process training on batches drawn with a seeded generator; returns the batch losses."""
    x_all, y_all = workload.train_dataset().tensors
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(x_all), (batch_size,), generator=generator)
        loss = workload.training_step(model, (x_all[idx], y_all[idx]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_digits_dataset_shapes_and_dtypes():
    workload = Digits()
    x, y = workload.train_dataset().tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.shape == (len(y), 64) and len(y) == 1437  # 80% of 1,797
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert set(y.tolist()) == set(range(10))
    assert isinstance(workload, Workload)


def test_digits_split_is_deterministic_and_ignores_torch_rng():
    torch.manual_seed(1)
    first = Digits().train_dataset().tensors
    torch.manual_seed(2)
    second = Digits().train_dataset().tensors
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    other_split = Digits(split_seed=1).train_dataset().tensors
    assert not torch.equal(first[0], other_split[0])


def test_digits_split_is_stratified_and_holds_out_each_image_once():
    _, labels = read_digits()
    for fraction, seed in [(0.2, 0), (0.2, 7), (0.05, 1), (0.9, 2)]:
        train, test = stratified_split(labels, fraction, seed)
        assert len(test) == math.ceil(fraction * len(labels))
        assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(len(labels)))  # disjoint, complete
        share = len(test) / len(labels)
        for label in range(10):
            assert abs(np.sum(labels[test] == label) - share * np.sum(labels == label)) < 1


SPLIT_DIGEST = """
import hashlib, sys
from raylastic.workloads.digits import Digits
x, y = Digits(split_seed=3).train_dataset().tensors
print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest(), "sklearn" in sys.modules)
"""


@pytest.mark.processes
def test_digits_split_is_the_same_in_every_process_and_imports_no_scikit_learn():
    x, y = Digits(split_seed=3).train_dataset().tensors
    here = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
    done = subprocess.run([sys.executable, "-c", SPLIT_DIGEST], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == [here, "False"]  # scikit-learn's import would cost a new worker ~0.8 s


def test_digits_trains_to_high_accuracy():
    workload = Digits()
    torch.manual_seed(0)
    model = workload.build_model()
    before = workload.evaluate(model)
    assert 0.0 <= before["accuracy"] <= 1.0
    _adam_steps(workload, model, 150, batch_size=256, lr=1e-2)
    after = workload.evaluate(model)
    assert after["accuracy"] >= 0.90
    assert after["eval_loss"] < before["eval_loss"]
    assert model.training  # evaluate restores train mode


def test_chargpt_corpus_is_identical_across_instances():
    first, second = CharGPT(), CharGPT()
    pairs = zip(first.train_dataset().tensors, second.train_dataset().tensors, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(first._eval_windows, second._eval_windows)


def test_chargpt_shapes_and_initial_loss():
    workload = CharGPT(**SMALL_GPT)
    x, y = workload.train_dataset().tensors
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and x.shape[1] == 32
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one byte
    torch.manual_seed(0)
    model = workload.build_model()
    logits = model(x[:4])
    assert logits.shape == (4, 32, 256)
    mean_loss = workload.training_step(model, (x[:4], y[:4])).item()
    assert abs(mean_loss - math.log(256)) < 0.5
    metrics = evaluated(workload, model)
    assert abs(metrics["eval_loss"] - math.log(256)) < 0.5
    assert metrics["bits_per_byte"] == pytest.approx(metrics["eval_loss"] / math.log(2))


def test_chargpt_eval_loss_is_the_mean_next_byte_loss_over_its_held_out_windows_in_any_batch_size():
    workload = CharGPT(**SMALL_GPT)
    torch.manual_seed(0)
    model = workload.build_model()
    inputs, targets = workload.eval_dataset().tensors
    assert len(inputs) == 64 and torch.equal(inputs[:, 1:], targets[:, :-1])
    with torch.no_grad():
        every_byte = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
    for batch_size in (64, 5):  # 5: the last batch holds 4 windows
        assert evaluated(workload, model, batch_size)["eval_loss"] == pytest.approx(every_byte, rel=1e-5)


def test_chargpt_adam_steps_decrease_loss():
    workload = CharGPT(**SMALL_GPT)
    torch.manual_seed(0)
    model = workload.build_model()
    before = evaluated(workload, model)["eval_loss"]
    losses = _adam_steps(workload, model, 20, batch_size=16, lr=3e-3)
    assert losses[-1] < losses[0] - 1.0
    assert evaluated(workload, model)["eval_loss"] < before - 1.0
    assert model.training


@pytest.mark.parametrize("shape", [(2, 2, 64, 64), (3, 4, 48, 16)])
def test_chargpt_num_parameters_matches_model(shape):
    n_layer, n_head, n_embd, block_size = shape
    model = CharGPT(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                    corpus_chars=20_000).build_model()
    assert CharGPT.num_parameters(*shape) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("cls", "options", "option_name"), [
    (Digits, {"hidden": 0}, "hidden"),
    (Digits, {"hidden": 1.5}, "hidden"),
    (Digits, {"test_fraction": 1.0}, "test_fraction"),
    (Digits, {"split_seed": -1}, "split_seed"),
    (CharGPT, {"n_layer": 0}, "n_layer"),
    (CharGPT, {"n_head": True}, "n_head"),
    (CharGPT, {"n_embd": 30, "n_head": 4}, "n_embd"),
    (CharGPT, {"block_size": -4}, "block_size"),
    (CharGPT, {"corpus_chars": 10**12}, "corpus_chars"),
    (CharGPT, {"corpus_chars": 100}, "corpus_chars"),
    (CharGPT, {"test_fraction": 0}, "test_fraction"),
])
def test_bad_options_raise_value_error_naming_the_option(cls, options, option_name):
    with pytest.raises(ValueError, match=f"workload.options.{option_name}"):
        cls(**options)


def test_registry_loads_builtin_workloads():
    workload = load_workload("digits", {"hidden": 16})
    assert isinstance(workload, Digits) and workload.hidden == 16
    assert isinstance(load_workload("raylastic.workloads.chargpt:CharGPT", {"corpus_chars": 20_000}), CharGPT)


@pytest.mark.parametrize(("name", "options", "message"), [
    ("nope:Nope", None, "cannot import module 'nope'"),
    ("nope", None, "is not a built-in name"),
    ("raylastic.workloads.digits:Nope", None, "has no class 'Nope'"),
    ("digits", {"bogus": 1}, "are not accepted"),
    ("digits", {"hidden": 0}, "workload.options.hidden"),
])
def test_registry_errors_are_value_errors(name, options, message):
    with pytest.raises(ValueError, match=message):
        load_workload(name, options)


BROKEN_MODULES = {
    "syntax": ("def build_model(:\n", ["SyntaxError", "invalid syntax", "line 1"]),
    "raises": ("import os\nraise RuntimeError('no data at /data/train')\n",
               ["RuntimeError: no data at /data/train", "raises.py:2"]),
    "needs": ("import not_installed_anywhere\n", ["ModuleNotFoundError", "not_installed_anywhere", "needs.py:1"]),
}


@pytest.mark.parametrize("kind", list(BROKEN_MODULES))
def test_a_workload_module_that_fails_on_import_is_named_with_its_error(tmp_path, monkeypatch, kind):
    source, fragments = BROKEN_MODULES[kind]
    module = f"broken_{kind}_{tmp_path.name}"  # a fresh name: nothing cached in sys.modules
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as raised:
        load_workload(f"{module}:Workload")
    message = str(raised.value).replace(module, kind)
    assert message.startswith(f"workload.name='{kind}:Workload': importing module '{kind}' raised"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_a_workload_constructor_that_raises_is_named_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "needs_data.py").write_text(
        "from raylastic.workloads.digits import Digits\n\n"
        "class NeedsData(Digits):\n"
        "    def __init__(self, path='/data/train.bin'):\n"
        "        raise FileNotFoundError(path)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"workload 'needs_data:NeedsData': constructing NeedsData\(\*\*\{\}\) "
                                         r"raised FileNotFoundError: /data/train.bin \(.*needs_data.py:5\)"):
        load_workload("needs_data:NeedsData")


def evaluated(workload, model: torch.nn.Module, batch_size: int = 64) -> dict[str, float]:
    """The metrics a run reports for ``model`` (one process): the workload's evaluate and eval_dataset's."""
    return Evaluator(workload, batch_size=batch_size, device=torch.device("cpu")).run(model)

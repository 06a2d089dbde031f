"""A Hugging Face ``transformers`` causal LM with a ``datasets.Dataset`` trains under ddp and zero2.

Dict batches, HF's loss, GPT-2's tied embedding / lm head and dropout, through the real job on a
local Ray with gloo::

    .venv/bin/pytest -q tests/test_huggingface.py
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from raylastic.cluster.job import train  # noqa: E402
from tests.support.helpers import job, load_model  # noqa: E402
from tests.support.hf_workload import TinyCausalLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 40
EVAL_EVERY = 10


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_tiny_causal_lm_learns_and_its_model_file_loads(tmp_path, strategy):
    run_dir = tmp_path / strategy
    result = train(job("workload.name=tests.support.hf_workload:TinyCausalLM", f"strategy.name={strategy}",
                       f"training.steps={STEPS}", "training.global_batch_size=32", "optim.lr=3e-3",
                       "optim.schedule=cosine", "optim.warmup_steps=5", "optim.clip_grad_norm=1.0",
                       f"eval.every_steps={EVAL_EVERY}", name=f"hf-{strategy}"), run_dir=run_dir)

    assert result.final_step == STEPS
    assert [row["step"] for row in result.history] == list(range(1, STEPS + 1))
    assert all({"lr", "grad_norm"} <= row.keys() for row in result.history)
    losses = [row["loss"] for row in result.history]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"the loss did not fall: {first:.3f} -> {last:.3f}"

    ln_vocab = math.log(TinyCausalLM().config.vocab_size)
    # The periodic rows (10, 20, 30), then the final metrics' (the run's end).
    assert [row["step"] for row in result.eval_history] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert result.eval_history[-1]["eval_loss"] == result.metrics["eval_loss"]
    eval_losses = [row["eval_loss"] for row in result.eval_history]
    assert eval_losses == sorted(eval_losses, reverse=True), eval_losses
    assert result.metrics["eval_loss"] < ln_vocab - 0.5

    workload = TinyCausalLM()
    model = workload.build_model()
    model.load_state_dict(load_model(run_dir))  # strict: every key, the tied lm_head's included
    assert model.lm_head.weight is model.transformer.wte.weight
    model.eval()
    with torch.no_grad():
        held_out = workload.eval_dataset()[:]
        eval_loss = workload.eval_step(model, held_out)["eval_loss"].item() / len(held_out["input_ids"])
    assert eval_loss == pytest.approx(result.metrics["eval_loss"], rel=1e-4)  # model.pt is the trained model

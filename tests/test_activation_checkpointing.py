"""Activation checkpointing (training.activation_checkpointing) changes memory, not the math.

The built-in GPT with dropout trains to the same parameters with its blocks recomputed in full or selectively as
without, under ddp and under zero3 x tp2, and its checkpoints keep the names they have without it.

    python -m pytest tests/test_activation_checkpointing.py -q
"""

from __future__ import annotations

import pytest
import torch

from raylastic.strategies.activation_checkpointing import SAVED_OPS, checkpoint_blocks
from raylastic.strategies.model_parts import canonical_name
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.workloads.chargpt import GPT
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import assert_states_close, job, tokenized_stdlib
from tests.support.parallel_runs import train_and_report


@pytest.fixture(scope="module")
def gpt_with_dropout(tmp_path_factory) -> tuple[str, dict]:
    """The gpt workload (dropout 0.1) on the first ~200 KB of the standard library's source."""
    directory = tokenized_stdlib(tmp_path_factory.mktemp("tokens"), 200_000)
    return "gpt", {"data_dir": str(directory), "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                   "dropout": 0.1}


@pytest.fixture(scope="module")
def kept(gpt_with_dropout) -> dict:
    """One process, every activation kept."""
    return run_distributed(train_and_report, 1, None, "ddp", "fp32", None, gpt_with_dropout, "none", timeout_s=120)[0]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_blocks_with_dropout_train_exactly_as_kept_ones(gpt_with_dropout, kept, mode):
    recomputed = run_distributed(train_and_report, 1, None, "ddp", "fp32", None, gpt_with_dropout, mode,
                                 timeout_s=120)[0]
    assert_states_close(recomputed["state"], kept["state"], rtol=0, atol=0)  # its keys: no wrapper in a name
    assert recomputed["reported"] == kept["reported"]


def test_full_recompute_under_zero3_and_tp2_trains_as_without(gpt_with_dropout):
    layout = ParallelLayout(dp_shard=2, tp=2)
    kept = run_distributed(train_and_report, 4, layout, "zero3", "fp32", None, gpt_with_dropout, "none",
                           timeout_s=240)[0]
    recomputed = run_distributed(train_and_report, 4, layout, "zero3", "fp32", None, gpt_with_dropout, "full",
                                 timeout_s=240)[0]
    assert_states_close(recomputed["state"], kept["state"], rtol=1e-5, atol=1e-6)
    assert [r[0] for r in recomputed["reported"][0]] == pytest.approx([r[0] for r in kept["reported"][0]])


def test_the_blocks_are_wrapped_and_their_names_canonical():
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=16)
    names = [name for name, _ in model.named_parameters()]
    checkpoint_blocks(model, "full")
    wrapped = [name for name, _ in model.named_parameters()]
    assert all("_checkpoint_wrapped_module" in name for name in wrapped if name.startswith("blocks."))
    assert [canonical_name(name) for name in wrapped] == names
    assert list(model.state_dict()) == [n for n in GPT(n_layer=2, n_head=2, n_embd=32, block_size=16).state_dict()]
    assert torch.ops.aten.mm.default in SAVED_OPS


def test_activation_checkpointing_is_refused_where_it_would_be_ignored():
    with pytest.raises(ValueError, match="training.activation_checkpointing must be one of none, full, selective"):
        job("training.activation_checkpointing=some")
    with pytest.raises(ValueError, match="training.activation_checkpointing is not supported with strategy.name="
                                         "async_ps"):
        job("strategy.name=async_ps", "training.activation_checkpointing=full")

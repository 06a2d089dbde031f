"""Pipeline stages of the built-in GPT (workloads/gpt_pipeline.py): the stages chained compute the whole model, their
parameter names split the whole model's without renaming any, and each stage splits over a tp group as the whole
model does (2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch

from raylastic.workloads.chargpt import GPT
from raylastic.workloads.gpt_pipeline import split_gpt, stage_blocks
from tests.support.distributed_harness import run_distributed
from tests.support.parallel_runs import tensor_parallel_stages


def _gpt(n_layer: int = 5, tie_embeddings: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, tie_embeddings=tie_embeddings)


def test_blocks_split_in_order_the_first_stages_taking_the_remainder():
    assert [list(stage_blocks(5, stage, 2)) for stage in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_blocks(4, stage, 4)) for stage in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="every stage needs a block"):
        stage_blocks(2, 0, 3)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_the_stages_chained_compute_the_whole_model_under_the_same_names(num_stages):
    whole = _gpt()
    stages = [split_gpt(copy.deepcopy(whole), stage, num_stages) for stage in range(num_stages)]
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    x = idx
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, whole(idx), rtol=0, atol=0)
    names = [set(stage.state_dict()) for stage in stages]
    assert set().union(*names) == set(whole.state_dict())
    assert sum(len(n) for n in names) == len(whole.state_dict())  # each parameter on one stage
    assert "wte.weight" in names[0] and "lm_head.weight" in names[-1]


def test_a_head_tied_to_the_embedding_is_refused():
    with pytest.raises(ValueError, match="set workload.options.tie_embeddings=false for parallel.pp > 1"):
        split_gpt(_gpt(tie_embeddings=True), 0, 2)
    assert split_gpt(_gpt(tie_embeddings=True), 0, 1) is not None  # one stage: the whole model, tie and all


def test_each_stage_splits_over_a_tp_group_and_the_chain_computes_the_whole_models_loss_and_gradients():
    differences = run_distributed(tensor_parallel_stages, 2, 2, timeout_s=120)[0]
    assert differences["names"]
    assert differences["loss"] < 1e-6 and differences["gradients"] < 1e-6, differences

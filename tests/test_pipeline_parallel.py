"""A step through a pipeline of the built-in GPT's stages (actors/worker/pipeline_step.py), on gloo, against one
process on the same batches: 2 stages under 1f1b and GPipe, with FSDP over the data-parallel ranks and tensor
parallelism inside each stage, end with the parameters (AdamW, clipping over every stage, a cosine schedule) and
the losses of the whole model. The workers do not use it yet: ``parallel.pp`` is refused until the step loop,
evaluation and the final model's gather run through it.

    python -m pytest tests/test_pipeline_parallel.py -q
"""

from __future__ import annotations

import pytest

from raylastic.strategies.parallel_layout import ParallelLayout
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import assert_states_close
from tests.support.parallel_runs import ADAM_TOLERANCE, UNTIED, pipeline_train_and_report, train_and_report


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(train_and_report, 1, None, "ddp", "fp32", None, UNTIED, timeout_s=120)[0]


@pytest.mark.parametrize(("layout", "strategy", "schedule", "microbatches"), [
    pytest.param(ParallelLayout(pp=2), "zero3", "1f1b", 2, id="pp2-1f1b"),
    pytest.param(ParallelLayout(pp=2), "zero2", "gpipe", 4, id="pp2-gpipe"),
    pytest.param(ParallelLayout(pp=2, tp=2), "zero3", "1f1b", 2, id="pp2-tp2"),
    pytest.param(ParallelLayout(pp=2, dp_shard=2), "zero3", "1f1b", 2, id="pp2-dp2"),
])
def test_a_pipelined_step_trains_as_one_process(reference, layout, strategy, schedule, microbatches):
    got = run_distributed(pipeline_train_and_report, layout.world_size, layout, strategy, schedule, microbatches,
                          timeout_s=240)[0]
    assert_states_close(got["state"], reference["state"], rtol=1e-4, atol=ADAM_TOLERANCE)
    if layout.dp == 1:  # rank 0 reports its data-parallel share's loss
        assert got["losses"] == pytest.approx([loss for loss, _, _ in reference["reported"][0]], rel=1e-5)

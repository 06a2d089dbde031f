"""DiLoCo and local SGD (strategies/diloco.py): the math against synchronous DDP, 16-bit pseudo-gradients and
checkpoints in gloo groups of local processes; real runs on a local Ray: a worker lost between two outer steps,
and the GPT recipe's validation loss against DDP's.

    .venv/bin/pytest -q tests/test_diloco.py
"""

from __future__ import annotations

import pytest
import torch

from raylastic.cluster.job import train
from raylastic.jobconfig import load_job_config
from raylastic.tuning.search_space import SearchSpace
from tests.support.distributed_harness import run_distributed as run_on_ranks
from tests.support.helpers import job, tokenized_stdlib
from tests.support.strategy_runs import (
    outer_step_after_many_samples,
    restore_and_report,
    train_and_count_bytes,
    train_and_report,
)

LOCAL_SGD_EVERY_STEP = {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}


def _assert_ddps_parameters_after_4_sgd_steps(options: dict) -> None:
    """diloco with ``options`` at 3 ranks ends where DDP at 1 rank does."""
    reference = run_on_ranks(train_and_report, 1, "ddp", 4, None, "sgd")[0]
    state = run_on_ranks(train_and_report, 3, "diloco", 4, None, "sgd", 1, None, options)[0]
    parameters = [key for key in reference if key.startswith("model.")]
    assert parameters
    for key in parameters:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)


def test_local_sgd_syncing_every_step_is_ddp():
    """Inner SGD with momentum is linear in the gradients, so averaging the ranks' updates every step is
    averaging their gradients: the same parameters as DDP on the whole batch (each rank's momentum buffer is
    its own; their mean is DDP's)."""
    _assert_ddps_parameters_after_4_sgd_steps(LOCAL_SGD_EVERY_STEP)


def test_a_warm_up_averages_every_step_without_the_outer_optimizer():
    """Through ``sync_warmup_steps`` every step ends in a plain average, the outer Nesterov SGD (lr 0.7, momentum
    0.9) left out: with an SGD inner optimizer, DDP's parameters. After it, outer steps every ``sync_every``."""
    _assert_ddps_parameters_after_4_sgd_steps({"sync_every": 50, "outer_lr": 0.7, "outer_momentum": 0.9,
                                               "sync_warmup_steps": 4})
    sent = run_on_ranks(train_and_count_bytes, 2, "diloco", 7,
                        {"sync_every": 3, "outer_momentum": 0.9, "sync_warmup_steps": 2})[0]["bytes_sent"]
    assert [index + 1 for index, count in enumerate(sent) if count] == [1, 2, 3, 6]
    with pytest.raises(ValueError, match="strategy.sync_warmup_steps must be a non-negative integer, got -1"):
        load_job_config(None, ["strategy.name=diloco", "strategy.sync_warmup_steps=-1"])


def test_outer_steps_differ_from_ddp_when_workers_train_apart():
    reference = run_on_ranks(train_and_report, 1, "ddp", 4, None, "adamw")[0]
    state = run_on_ranks(train_and_report, 3, "diloco", 4, None, "adamw", 1, None,
                         {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9})[0]
    assert any(not torch.allclose(state[key], reference[key]) for key in reference if key.startswith("model."))
    assert any(key.startswith("outer.") for key in state)  # the outer momentum is part of the state


def test_a_checkpoint_after_an_outer_step_resumes_at_another_world_size(tmp_path):
    options = {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
    saved = run_on_ranks(train_and_report, 3, "diloco", 4, str(tmp_path), "adamw", 1, None, options)[0]
    directory = next(tmp_path.glob("step_*"))
    restored = run_on_ranks(restore_and_report, 2, "diloco", str(directory))[0]
    assert saved.keys() == restored.keys()
    shared = [key for key in saved if key.startswith(("model.", "outer."))]  # the inner state is each worker's own
    assert any(key.startswith("outer.") for key in shared)
    for key in shared:
        torch.testing.assert_close(restored[key], saved[key], msg=key)


@pytest.fixture(scope="module")
def compressed_runs():
    """6 steps at world size 2 with an outer step every 2, the pseudo-gradient in float32, float16 and bfloat16."""
    options = {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
    return {kind: run_on_ranks(train_and_count_bytes, 2, "diloco", 6, {**options, "compression": kind})[0]
            for kind in ("none", "fp16", "bf16")}


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_16_bit_pseudo_gradient_halves_the_bytes_and_stays_close(compressed_runs, kind):
    full, compressed = compressed_runs["none"], compressed_runs[kind]
    count_bytes = 8  # the int64 sample count all-reduced before the change
    assert full["bytes_sent"][0::2] == compressed["bytes_sent"][0::2] == [0, 0, 0]  # inner steps send nothing
    for sent, fp32 in zip(compressed["bytes_sent"][1::2], full["bytes_sent"][1::2], strict=True):
        assert 2 * (sent - count_bytes) == fp32 - count_bytes > 0
    assert compressed["uncompressed_bytes"] == full["bytes_sent"] == full["uncompressed_bytes"]
    parameters = [key for key in full["state"] if key.startswith("model.")]
    rounded = [key for key in parameters if not torch.equal(compressed["state"][key], full["state"][key])]
    assert rounded  # the 16-bit sum did round
    for key in parameters:  # the parameters' largest move in these 6 steps is ~0.1
        torch.testing.assert_close(compressed["state"][key], full["state"][key], rtol=0, atol=5e-3, msg=key)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_16_bit_pseudo_gradient_does_not_overflow_with_many_samples(kind):
    """Weighted by 100,000 and 200,000 samples, the ranks' changes (0.5 and 1.0) would sum to 250,000, past
    float16's 65,504: each rank scales its change by its share of the samples before the sum instead."""
    updated = run_on_ranks(outer_step_after_many_samples, 2, kind, 100_000, 0.5)[0]
    torch.testing.assert_close(updated, torch.full_like(updated, -(0.5 + 2 * 1.0) / 3), rtol=1e-2, atol=0)


@pytest.mark.parametrize("kind", ["powersgd", "topk", "onebit", "int8"])
def test_diloco_takes_16_bit_compression_only(kind):
    with pytest.raises(ValueError, match=f"strategy.compression with strategy.name=diloco takes none, fp16 or bf16, "
                                         f"got '{kind}'"):
        load_job_config(None, ["strategy.name=diloco", f"strategy.compression={kind}"])
    assert load_job_config(None, ["strategy.name=diloco", "strategy.compression=bf16"]).strategy.compression == "bf16"
    with pytest.raises(ValueError, match="strategy.compression works with strategy.name=ddp or diloco only"):
        load_job_config(None, ["strategy.name=zero1", "strategy.compression=fp16"])


def test_checkpoints_must_fall_on_outer_steps():
    with pytest.raises(ValueError, match=r"checkpoint.every_steps \(15\) must be a multiple of strategy.sync_every"):
        load_job_config(None, ["strategy.name=diloco", "strategy.sync_every=10", "checkpoint.every_steps=15"])
    ddp, diloco = (load_job_config(None, [f"strategy.name={name}"]) for name in ("ddp", "diloco"))
    assert ddp.math_hash() != diloco.math_hash()  # one's checkpoints never resume the other
    bf16 = load_job_config(None, ["strategy.name=diloco", "strategy.compression=bf16"])
    assert bf16.math_hash() == diloco.math_hash()  # the wire's precision, like ddp's compression: either resumes


def test_sync_every_is_a_sweepable_key():
    base = load_job_config(None, ["strategy.name=diloco"])
    space = SearchSpace.from_dict({"strategy.sync_every": {"choice": [10, 50]}})
    space.validate(base)
    assert space.apply(base, {"strategy.sync_every": 10}).strategy.sync_every == 10


@pytest.mark.usefixtures("ray_local")
def test_a_worker_lost_between_outer_steps_costs_only_its_own_inner_steps(tmp_path):
    steps, every = 100, 10
    base = ["strategy.name=diloco", f"strategy.sync_every={every}", f"training.steps={steps}",
            "scaling.min_workers=2", "scaling.max_workers=3", "optim.lr=3e-3"]
    killed = train(job(*base, "faults=[{action: kill, rank: 1, step: 25}]", name="diloco-kill"),
                   run_dir=tmp_path / "kill")
    assert killed.final_step == steps and killed.metrics["accuracy"] > 0.85, killed.metrics
    synced = [row["step"] for row in killed.history if row["bytes_sent"]]
    assert synced == list(range(every, steps + 1, every))  # one all-reduce per outer step, a loss between two too
    formed = [e for e in killed.events if e.type == "generation_formed"]
    assert len(formed) >= 2 and all(e.details["steps_lost"] == 0 for e in formed)
    assert all(isinstance(e.details["state_source"], int) for e in formed[1:])  # from a survivor, not a restart
    rows = {row["step"]: row for row in killed.history}
    assert rows[26]["loss"] < 0.5 * rows[1]["loss"]  # the survivors' training went on


@pytest.fixture(scope="module")
def stdlib_tokens(tmp_path_factory):
    """The GPT recipe's data (``raylastic tokenize --stdlib``), cut to the first ~1 MB of the standard library."""
    return tokenized_stdlib(tmp_path_factory.mktemp("tokens"), 1_000_000)


@pytest.mark.usefixtures("ray_local")
def test_diloco_at_h_50_after_a_synchronous_start_reaches_ddps_validation_loss_on_the_gpt_recipe(tmp_path,
                                                                                               stdlib_tokens):
    """Issue 20: at H = 50, after a synchronous start of 2H steps, within 5% of DDP's validation loss after the
    same samples. The recipe of examples/gpt_elastic.yaml (AdamW, warm-up then cosine, clipping, dropout), shrunk
    to 2 layers of width 64 so that 400 steps run in ~20 s, at training.seed 2: the worst of seeds 0-4 for plain
    DiLoCo (DDP 2.017, DiLoCo +15.6%; with this start +3.0%; seeds 0-4 with it: +0.3% to +3.0%). Even batch
    shares: under load, ddp's shares would follow the ranks' measured speed and, with dropout, draw other masks."""
    steps, every = 400, 50
    recipe = ["workload.name=gpt", f"workload.options={{data_dir: {stdlib_tokens}, n_layer: 2, n_head: 2, "
              "n_embd: 64, block_size: 32, eval_blocks: 128}", f"training.steps={steps}", "training.seed=2",
              "training.global_batch_size=16", "scaling.min_workers=2", "scaling.max_workers=2", "optim.lr=3e-3",
              "optim.schedule=cosine", "optim.warmup_steps=25", "optim.min_lr=3e-4", "optim.clip_grad_norm=1.0",
              f"eval.every_steps={every}", "scaling.balance=off"]
    strategies = {"ddp": ["strategy.name=ddp"],
                  "diloco": ["strategy.name=diloco", f"strategy.sync_every={every}",
                             f"strategy.sync_warmup_steps={2 * every}"]}
    results = {name: train(job(*recipe, *strategy, name=f"gpt-{name}"), run_dir=tmp_path / name)
               for name, strategy in strategies.items()}
    synced = [row["step"] for row in results["diloco"].history if row["bytes_sent"]]
    assert synced == list(range(1, 2 * every + 1)) + list(range(3 * every, steps + 1, every))
    losses = {name: result.eval_history[-1]["eval_loss"] for name, result in results.items()}
    assert all(result.eval_history[-1]["step"] == steps for result in results.values())
    assert losses["diloco"] <= 1.05 * losses["ddp"], losses

"""Re-planning a model-parallel state in place (issue 33): the parts the survivors of one layout kept in memory
(strategies/region_copy.py) make the state of another, each rank receiving only the regions it lacks
(strategies/region_plan.py plans who sends what).

    python -m pytest tests/test_relayout.py -q
"""

from __future__ import annotations

import json

import pytest
import ray
import torch

from raylastic.actors.status.run import RunFailed
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import controller_name
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.region_plan import RegionCopy, plan_region_restore
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import job
from tests.support.parallel_runs import relayout_each_and_report
from tests.support.strategy_runs import TINY_GPT_OPTIONS, assert_trained_as_undisturbed, undisturbed_alongside

RELAYOUTS = {  # old layout and strategy, new layout and strategy, the old ranks whose parts are lost
    "pp2-dp2-to-dp2-tp2": (ParallelLayout(pp=2, dp_replicate=2), "ddp", ParallelLayout(dp_shard=2, tp=2), "zero3",
                           (1,)),
    "dp2-tp2-to-pp2-tp2": (ParallelLayout(dp_replicate=2, tp=2), "ddp", ParallelLayout(pp=2, tp=2), "zero2", (3,)),
    "pp2-tp2-to-dp4": (ParallelLayout(pp=2, tp=2), "zero3", None, "zero3", ()),
}


@pytest.fixture(scope="module")
def relayouts() -> dict[str, dict]:
    """Every case of RELAYOUTS, one after the other on the same 4 ranks."""
    return dict(zip(RELAYOUTS, run_distributed(relayout_each_and_report, 4, list(RELAYOUTS.values()),
                                               timeout_s=300)[0], strict=True))


@pytest.mark.parametrize("case", RELAYOUTS)
def test_a_state_kept_in_parts_is_laid_out_anew_exactly(relayouts, case):
    got, lost = relayouts[case], RELAYOUTS[case][-1]
    assert got["restored"].keys() == got["trained"].keys()
    for key, tensor in got["trained"].items():
        assert torch.equal(got["restored"][key], tensor), key
    assert all(sender not in lost for sender in got["plan"].senders.values())
    for rank in lost:  # a rank without copies receives all it holds, the others only what they lack
        assert got["traffic"][rank].bytes_received > 0


def test_the_plan_takes_the_newest_complete_state_from_the_lowest_holders():
    layout = ParallelLayout(pp=2, dp_replicate=2)
    copies = [[RegionCopy(3, layout, old, 40)] for old in (0, 2, 3)]
    plan = plan_region_restore(copies)
    assert (plan.step, plan.senders) == (40, {(0, 0, 0): 0, (1, 0, 0): 1})
    assert plan_region_restore([copies[1], copies[2]]) is None  # stage 0 lost with both its copies
    older = [RegionCopy(2, layout, old, 39) for old in range(4)]
    assert plan_region_restore([copies[0] + older[:2], copies[1] + older[2:]]).step == 40
    sharded = ParallelLayout(pp=2, dp_shard=2)
    assert plan_region_restore([[RegionCopy(0, sharded, old, 5)] for old in (0, 1, 2)]) is None  # piece (1, 1, 0)


def test_a_buddy_copy_stands_in_for_a_lost_part_and_a_spares_part_is_handed_to_a_member():
    """pp2 x tp2, old rank 1 lost: old rank 2 holds its buddy copy (of the step before: the newest exchange did not
    complete), every survivor its own part of that step; the layout takes two members, old rank 3 waits as a
    spare, so its part is handed to a member, which sends it on."""
    layout = ParallelLayout(pp=2, tp=2)
    own = {old: [RegionCopy(0, layout, old, step) for step in (3, 4)] for old in (0, 2, 3)}
    buddy = RegionCopy(0, layout, 1, 3, holder="buddy")
    plan = plan_region_restore([own[0], own[2] + [buddy], own[3]], members=2)
    assert (plan.step, plan.from_buddies) == (3, ((0, 0, 1),))
    assert plan.senders == {(0, 0, 0): 0, (0, 0, 1): 1, (1, 0, 0): 1, (1, 0, 1): 0}
    assert plan.deliveries == {0: ((2, RegionCopy(0, layout, 3, 3)),)}
    assert plan_region_restore([own[0], own[2], own[3]], members=2) is None  # no copy of old rank 1's part


@pytest.mark.usefixtures("ray_local")
def test_a_dp2_pp2_run_that_loses_a_worker_mid_schedule_goes_on_in_place_and_grows_back_from_memory(tmp_path):
    """Two copies of a two-stage pipeline (ddp over them) on 4 workers; rank 2 (stage 1 of the first copy) is
    killed inside step 5, as it is about to run its second micro-batch's forward, with no checkpoint written. No
    rank commits step 5: the survivors re-form as one pipeline in place (the other copy of stage 0 waits as a
    spare), so no byte moves, and redo it in the step's 4 micro-batches of 2 samples. When the replacement is
    ready, it and the spare complete a second pipeline: the run grows back to (dp2, pp2) from the members' memory.
    It ends with an undisturbed run's parameters and every step applied once."""
    steps = 30
    # slow while small (1.2 s a step, 25 steps): room for the replacement to start; the pause ends once it joined
    options = TINY_GPT_OPTIONS[:-1] + ", pause_s: 0.3, full_world: 4}"
    disturbed = job("workload.name=tests.support.user_workload:CharGPTSlowWhileSmall", options, "parallel.pp=2",
                    "strategy.name=ddp", "scaling.min_workers=2", "scaling.max_workers=4", f"training.steps={steps}",
                    "training.global_batch_size=8", "training.record_samples=true", "checkpoint.every_steps=0",
                    "scaling.cpus_per_worker=0.25", "faults=[{action: kill, rank: 2, step: 5, microbatch: 1}]",
                    name="dp-pp-kill")
    undisturbed = undisturbed_alongside(disturbed)
    result = train(disturbed, run_dir=tmp_path / "run")
    formed = [e.details | {"step": e.step} for e in result.events if e.type == "generation_formed"]
    keys = ("layout", "microbatches", "state_source", "step", "steps_lost")
    assert [tuple(f[key] for key in keys) for f in formed] == [
        ("pp2 x dp2 (2 copies)", 2, "initialisation", 0, 0),
        ("pp2", 4, "peers", 4, 0),  # step 5 was in flight: nothing committed is redone
        ("pp2 x dp2 (2 copies)", 2, "peers", formed[2]["step"], 0)], formed
    assert (formed[1]["previous_layout"], formed[1]["moved_bytes"]) == ("pp2 x dp2 (2 copies)", 0)
    assert formed[2]["step"] < steps
    assert_trained_as_undisturbed(result, disturbed, tmp_path / "run", steps, undisturbed.result(timeout=600))


@pytest.mark.usefixtures("ray_local")
def test_a_dp2_pp2_run_that_loses_both_copies_of_a_stage_with_no_checkpoint_ends_naming_what_was_lost(tmp_path):
    """Ranks 2 and 3 hold the two copies of stage 1 and are killed in the same step, with no checkpoint written: the
    stage exists nowhere, so the run ends saying so (not that "a worker and its buddy" were lost) and keeps its
    result.json, rather than start over from step 0."""
    disturbed = job("workload.name=chargpt", TINY_GPT_OPTIONS, "parallel.pp=2", "strategy.name=ddp",
                    "scaling.min_workers=2", "scaling.max_workers=4", "training.steps=8",
                    "training.global_batch_size=8", "checkpoint.every_steps=0", "checkpoint.every_minutes=0",
                    "scaling.cpus_per_worker=0.25",
                    "faults=[{action: kill, rank: 2, step: 3}, {action: kill, rank: 3, step: 3}]", name="stage-lost")
    with pytest.raises(RunFailed) as failure:
        train(disturbed, run_dir=tmp_path / "run")
    assert str(failure.value).startswith(
        "the sharded state of step 2 is lost: every copy of one part of the model was lost (pp2 x dp2 (2 copies) "
        "kept 2, one in each data-parallel copy), and no intact checkpoint holds it (checkpoint.every_steps=0, "
        "checkpoint.every_minutes=0)"), \
        failure.value
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "failed"


@pytest.mark.usefixtures("ray_local")
def test_three_survivors_of_a_dp2_pp2_run_of_six_blocks_re_plan_to_pp3_from_memory_and_grow_back(tmp_path):
    """Two copies of a two-stage pipeline over a 6-block GPT; rank 2 (stage 1 of the first copy) is killed as step 4
    starts. The three survivors re-plan to three stages of two blocks (the layout policy's pick: a step's
    4 micro-batches through one 3-stage pipeline beat 2 stages with a spare), each receiving from the others' memory
    the blocks it lacks; when the replacement is ready, the run goes back to (dp2, pp2). No checkpoint is written or
    read, no committed step is lost, and the run ends with an undisturbed run's parameters."""
    steps = 20
    options = TINY_GPT_OPTIONS.replace("n_layer: 2", "n_layer: 6")[:-1] + ", pause_s: 0.1, full_world: 4}"
    disturbed = job("workload.name=tests.support.user_workload:CharGPTSlowWhileSmall", options, "parallel.pp=2",
                    "strategy.name=ddp", "scaling.min_workers=2", "scaling.max_workers=4", f"training.steps={steps}",
                    "training.global_batch_size=8", "training.record_samples=true", "checkpoint.every_steps=0",
                    "scaling.cpus_per_worker=0.25", "faults=[{action: kill, rank: 2, step: 4}]", name="pp3-replan")
    undisturbed = undisturbed_alongside(disturbed)
    result = train(disturbed, run_dir=tmp_path / "run")
    formed = [e.details | {"step": e.step} for e in result.events if e.type == "generation_formed"]
    keys = ("layout", "microbatches", "state_source", "steps_lost")
    assert [tuple(f[key] for key in keys) for f in formed] == [
        ("pp2 x dp2 (2 copies)", 2, "initialisation", 0), ("pp3", 4, "peers", 0),
        ("pp2 x dp2 (2 copies)", 2, "peers", 0)], formed
    assert formed[1]["previous_layout"] == "pp2 x dp2 (2 copies)" and formed[1]["moved_bytes"] > 0, formed
    assert [e.type for e in result.events].count("worker_failed") == 1, result.events  # no survivor held up
    assert formed[2]["previous_layout"] == "pp3" and formed[2]["moved_bytes"] > 0, formed
    assert not [e for e in result.events if e.type == "checkpointed" and e.step < steps]
    assert_trained_as_undisturbed(result, disturbed, tmp_path / "run", steps, undisturbed.result(timeout=600))


@pytest.mark.usefixtures("ray_local")
def test_a_drained_worker_of_a_pp2_tp2_run_hands_its_part_over_in_memory(tmp_path):
    """Two stages split over two workers each under zero3 with no copy of any part (``buddy_copy: false``); rank 1
    (stage 0's second tp rank) is drained: at the step boundary it leaves its group keeping its part, the three
    left form tp2 (one waits as a spare) and take the drained worker's part through Ray's object store, as a
    spare's. No checkpoint is written or read, no step is lost, and the run ends with an undisturbed run's
    parameters."""
    steps, name = 10, "pp-tp-drain"
    # The drain comes mid-run: asked when the driver's progress (polled once a second, its step a poll behind the
    # workers') shows step 3, it must land at a step boundary before step 10, so a step takes >= 0.4 s until then.
    options = TINY_GPT_OPTIONS[:-1] + ", pause_s: 0.05, full_pause_s: 0.2}"
    disturbed = job("workload.name=tests.support.user_workload:CharGPTSlowWhileSmall", options, "parallel.pp=2",
                    "parallel.tp=2", "strategy.name=zero3", "strategy.buddy_copy=false", "scaling.min_workers=1",
                    "scaling.max_workers=4", f"training.steps={steps}", "training.global_batch_size=8",
                    "training.record_samples=true", "checkpoint.every_steps=0", "scaling.cpus_per_worker=0.25",
                    name=name)
    drained: list[str] = []

    def drain_once(progress) -> None:
        if not drained and progress.state == "running" and progress.step >= 3:
            drained.extend(ray.get(ray.get_actor(controller_name(name)).drain.remote(rank=1)))

    undisturbed = undisturbed_alongside(disturbed)
    result = train(disturbed, run_dir=tmp_path / "run", on_progress=drain_once)
    formed = [e.details | {"step": e.step} for e in result.events if e.type == "generation_formed"]
    keys = ("layout", "state_source", "steps_lost")
    assert [tuple(f[key] for key in keys) for f in formed] == [
        ("pp2 x tp2", "initialisation", 0), ("tp2", "peers", 0)], formed
    assert formed[1]["moved_bytes"] > 0 and formed[1]["step"] >= 3, formed
    assert [e.details["worker"] for e in result.events if e.type == "worker_left"] == drained
    assert set(drained) <= set(formed[1]["handed_over_by"]), formed  # with the spare's part, if a piece needs it
    assert not [e for e in result.events if e.type == "checkpointed" and e.step < steps]
    assert_trained_as_undisturbed(result, disturbed, tmp_path / "run", steps, undisturbed.result(timeout=600))

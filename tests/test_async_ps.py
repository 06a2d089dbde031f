"""Asynchronous training with parameter servers (actors/async_ps/): the books and the servers in process, then
real runs on a local Ray - accuracy against synchronous DDP, a killed worker and a killed server, the staleness
bound, the sample ledger."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
import torch

from raylastic.actors.async_ps.checkpoints import newest_complete
from raylastic.actors.async_ps.prediction import STALENESS_AVERAGING, WeightPredictor
from raylastic.actors.async_ps.server import ParameterServer, ServerFailed, ServerSpec
from raylastic.actors.async_ps.shards import assign_parameters
from raylastic.actors.async_ps.tickets import TicketBook
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.status.run import RunFailed
from raylastic.actors.worker.optimizer_recipe import learning_rate, optimizer_factory, set_learning_rate
from raylastic.cluster.job import RunStopped, train
from raylastic.jobconfig import OptimConfig, TrainingConfig, WorkloadConfig, load_job_config
from raylastic.jobconfig.naming import controller_name
from raylastic.workloads import load_workload
from raylastic.workloads.digits import Digits
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import assert_states_close, job, load_model, wait_until_gone
from tests.support.strategy_runs import train_job_alone

DIGITS_TRAIN_SAMPLES = 1437


# -- the books ------------------------------------------------------------------------------------------------
def test_tickets_are_admitted_in_update_order_and_a_stale_one_goes_back():
    book = TicketBook(total_steps=4, max_staleness=1)
    first, second, third = (book.lease(w) for w in ("a", "b", "c"))
    assert (first, second, third) == (0, 1, 2)
    assert book.admit(first, "a", [0]).update == 1
    assert book.admit(second, "b", [0]).update == 2      # one update behind: allowed
    refused = book.admit(third, "c", [0])                # two behind
    assert refused.update is None and refused.staleness == 2 and book.refused == 1
    assert book.lease("c") == 2                           # the refused step comes back first
    assert book.lease("a") == 3 and book.lease("b") is None


def test_a_lost_worker_gives_its_leases_back_and_a_withdrawn_update_its_step():
    book = TicketBook(total_steps=3, max_staleness=4)
    book.lease("a"), book.lease("b")
    assert book.worker_lost("b") == [1]
    assert book.admit(0, "a", [0]).update == 1
    book.withdraw(1)                      # update 1 reached no server
    assert book.steps_applied == 0 and book.version == 1
    assert [book.lease("a"), book.lease("a"), book.lease("a")] == [0, 1, 2]
    with pytest.raises(ValueError, match="not leased to b"):
        book.admit(0, "b", [1])


def test_a_rewind_takes_back_every_later_update():
    book = TicketBook(total_steps=5, max_staleness=9)
    for update in range(4):
        ticket = book.lease("a")
        book.admit(ticket, "a", [update])
    book.lease("b")
    book.rewind(2, [0, 1, 2, 3])
    assert book.version == 2 and book.leases == {}
    assert [book.lease("a") for _ in range(3)] == [2, 3, 4]


def test_a_book_resumed_from_a_checkpoint_never_leases_an_applied_step_again():
    book = TicketBook(total_steps=6, max_staleness=9)
    book.rewind(4, [0, 2, 1, 4])                       # ticket 3 was refused, then the run stopped
    assert book.steps_applied == 4
    assert [book.lease("a") for _ in range(3)] == [3, 5, None]
    finished = TicketBook(total_steps=3, max_staleness=9)
    finished.rewind(3, [0, 1, 2])
    assert finished.done and finished.lease("a") is None


def test_parameters_are_spread_over_servers_by_size():
    shards = assign_parameters({"w1": 1000, "b1": 10, "w2": 600, "b2": 5}, num_servers=2)
    assert shards == [["w1"], ["w2", "b1", "b2"]]
    assert assign_parameters({"w": 3}, num_servers=2) == [["w"], []]


# -- a server in this process -----------------------------------------------------------------------------------
def server_spec(tmp_path, num_servers=1, max_staleness=1, every_steps=0):
    return ServerSpec(workload=WorkloadConfig(), optim=OptimConfig(), training=TrainingConfig(steps=10),
                      max_staleness=max_staleness, num_servers=num_servers, predict_weights=True,
                      checkpoint_root=str(tmp_path), every_steps=every_steps, config_hash="h")


def gradients_of(server: ParameterServer, value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(p, value) for name, p in server.params.items()}


def digits_names() -> list[str]:
    return [name for name, _ in load_workload("digits").build_model().named_parameters()]


def wait_written(server: ParameterServer, version: int) -> None:
    """Until the server's saver wrote ``version`` (its own thread writes while the server goes on)."""
    deadline = time.monotonic() + 120
    while server.beat().written < version:
        assert time.monotonic() < deadline, f"version {version} was not written in 120 s"
        time.sleep(0.01)


def test_a_server_applies_updates_in_their_order(tmp_path):
    server = ParameterServer(server_spec(tmp_path), index=0, names=digits_names())
    epoch, _, before = server.pull()
    before = {name: tensor.clone() for name, tensor in before.items()}
    assert server.push(epoch, 2, 0, gradients_of(server, 1.0), {}, ticket=1)
    assert server.version == 0                                   # update 2 waits for update 1
    assert server.push(epoch, 1, 0, gradients_of(server, 1.0), {}, ticket=0)
    assert server.version == 2 and server.max_applied_staleness == 1
    applied = {name: tensor.clone() for name, tensor in server.pull()[2].items()}
    assert any(not torch.equal(applied[n], before[n]) for n in before)
    assert not server.push(epoch + 1, 5, 2, gradients_of(server, 1.0), {}, ticket=4)  # another epoch's: refused
    assert not server.skip(epoch, 4) and server.version == 2                     # 3 still holds 4 back
    assert server.skip(epoch, 2)                                                 # applied already


def test_a_server_whose_update_raises_fails_for_good_with_its_traceback(tmp_path):
    """Issue 29: the update that raised was popped and every later one waited for it forever. Now the server
    keeps the error and raises it, with the traceback, at every later call (the Controller fails the run)."""
    server = ParameterServer(server_spec(tmp_path), index=0, names=digits_names())
    epoch = 0
    server.push(epoch, 1, 0, gradients_of(server, 1.0), {}, ticket=0)
    server.push(epoch, 2, 0, gradients_of(server, 1.0), {}, ticket=1)
    applied = {name: tensor.clone() for name, tensor in server.params.items()}
    assert server.push(epoch, 4, 2, gradients_of(server, 1.0), {}, ticket=3)   # held back for update 3
    with pytest.raises(ServerFailed, match=r"parameter server 0 failed applying update 3: StalenessViolation: "
                                           r"update 3 .* 2 updates old") as failed:
        server.push(epoch, 3, 0, gradients_of(server, 1.0), {}, ticket=2)
    assert "Traceback" in failed.value.details and "in _apply" in failed.value.details
    assert all(torch.equal(server.params[n], applied[n]) for n in applied)     # it never reached the parameters
    for call in (server.pull, server.beat, server.stats, lambda: server.skip(epoch, 5),
                 lambda: server.push(epoch, 5, 4, gradients_of(server, 1.0), {}, ticket=4)):
        with pytest.raises(ServerFailed) as again:
            call()
        assert again.value is failed.value


def test_a_checkpoint_of_two_servers_restores_into_one(tmp_path):
    names = [n for n, _ in load_workload("digits").build_model().named_parameters()]
    shards = assign_parameters({n: 1 for n in names}, num_servers=2)
    servers = [ParameterServer(server_spec(tmp_path, num_servers=2, every_steps=2), index=i, names=shards[i])
               for i in range(2)]
    for server in servers:
        server.restore(1, None, "0a")
    for update in (1, 2):
        for server in servers:
            server.push(1, update, 0, gradients_of(server, 0.1 * update), {}, ticket=update - 1)  # 2: 1 stale
    for server in servers:
        wait_written(server, 2)
    cut = newest_complete(str(tmp_path))
    assert (cut.version, cut.lineage, cut.num_servers) == (2, "0a", 2)
    saved = {**servers[0].state(), **servers[1].state()}
    served = {**servers[0].pull()[2], **servers[1].pull()[2]}  # update 2 was 1 stale: predicted parameters
    single = ParameterServer(server_spec(tmp_path, num_servers=1), index=0, names=names)
    restored = single.restore(2, cut, "0b")
    assert restored.version == 2 and restored.tickets == [0, 1]
    restored = single.state()
    for name, tensor in saved.items():
        torch.testing.assert_close(restored[name], tensor, msg=name)
        assert not torch.equal(served[name], tensor)
    assert single.optimizer.state  # AdamW's moments came back too
    for name, tensor in single.pull()[2].items():  # and the prediction's state
        torch.testing.assert_close(tensor, served[name], msg=name)


def test_weight_prediction_extrapolates_the_last_update_by_the_expected_staleness():
    w = torch.tensor([1.0, 2.0])
    predictor = WeightPredictor({"w": w})
    assert predictor.served(0)["w"] is w                       # every gradient fresh so far: w itself
    predictor.before_update()
    w -= torch.tensor([0.5, -1.0])                             # an update, 1 stale
    predictor.observe(1)
    s_hat = STALENESS_AVERAGING
    expected = w + s_hat * torch.tensor([-0.5, 1.0])
    torch.testing.assert_close(predictor.served(1)["w"], expected)
    state = predictor.state_dict()
    w -= 1.0                                                   # another update, not yet told to the predictor
    assert torch.equal(predictor.served(1)["w"], expected)     # version 1's prediction is kept for version 1
    again = WeightPredictor({"w": w.clone()})
    again.load_state_dict(state)
    assert again.expected_staleness == s_hat and torch.equal(again.previous["w"], torch.tensor([1.0, 2.0]))
    predictor.before_update()                                  # a skipped update: nothing to extrapolate
    assert torch.equal(predictor.served(2)["w"], w)


# -- real runs ------------------------------------------------------------------------------------------------
def applied_tickets(result, steps: int) -> None:
    """Every step's samples reached the parameters exactly once (the ledger's kept updates)."""
    order = GlobalSampleOrder(DIGITS_TRAIN_SAMPLES, 64, 0)
    kept = sorted(a["samples"] for applications in result.ledger.values() for a in applications if a["kept"])
    expected = sorted(order.rank_indices(step, 0, 1).tolist() for step in range(steps))
    assert kept == expected


@pytest.mark.usefixtures("ray_local")
def test_async_training_reaches_ddps_accuracy(tmp_path):
    settings = ["training.steps=300", "training.global_batch_size=64"]
    ps = train(job(*settings, "strategy.name=async_ps", "strategy.server_cpus=0.5", "eval.every_steps=100",
                   name="ps-run"), run_dir=tmp_path / "ps")
    assert ps.final_step == 300
    evaluated = [row["step"] for row in ps.eval_history]  # during training (as soon as 100 more steps are applied:
    assert len(evaluated) == 3 and 100 <= evaluated[0] < 200 <= evaluated[1] < 300 == evaluated[2]  # workers go on)
    ddp = Digits().build_model()  # DDP's parameters are the one-rank run's (test_elastic)
    ddp.load_state_dict(run_distributed(train_job_alone, 1, job(*settings, name="ps-ddp"), timeout_s=300)[0])
    ddp_accuracy = Digits().evaluate(ddp)["accuracy"]
    assert ps.metrics["accuracy"] >= ddp_accuracy - 0.02, (ps.metrics, ddp_accuracy)
    assert ps.metrics["max_applied_staleness"] <= 4
    rows = ps.history
    assert {row["worker"] for row in rows} == {"raylastic:ps-run:worker0.0", "raylastic:ps-run:worker1.0"}, \
        [e for e in ps.events if e.type == "worker_failed"]
    assert all(row["bytes_sent"] > 0 and row["bytes_received"] > 0 and row["world_size"] == 2 for row in rows)


@pytest.mark.usefixtures("ray_local")
def test_an_async_run_asked_to_stop_ends_stopped_with_its_servers_and_workers_gone(tmp_path):
    """The AsyncController's run states: a stop asked while it trains ends the run "stopped", not "failed", and keeps
    its version (it kept nothing)."""
    def stop_after_step_5(progress) -> None:
        if progress.step >= 5:
            os.kill(os.getpid(), signal.SIGTERM)  # as `ray job stop` does

    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped, match=r"run stopped by the user at step \d+"):
        train(job("training.steps=3000", "strategy.name=async_ps", "strategy.server_cpus=0.25", name="ps-stop"),
              run_dir=run_dir, on_progress=stop_after_step_5, stop_on_sigterm=True)
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "stopped" and 5 <= saved["final_step"] < 3000, saved.get("error")
    # the stop keeps the version the servers hold once the steps leased before it are pushed: a whole cut, model.pt
    assert saved["checkpoint"] == f"{run_dir}/checkpoints/ps_{saved['final_step']:08d}", saved
    assert newest_complete(str(run_dir / "checkpoints")).version == saved["final_step"]
    kept = torch.load(run_dir / "model.pt", weights_only=True)
    assert set(kept) == set(Digits().build_model().state_dict())
    wait_until_gone(controller_name("ps-stop"))
    deadline = time.monotonic() + 30
    while (alive := [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if ":ps-stop:" in a["name"]]):
        assert time.monotonic() < deadline, alive
        time.sleep(0.2)


@pytest.mark.usefixtures("ray_local")
def test_an_async_run_fails_when_min_workers_never_ask_for_a_step(tmp_path):
    """One worker alone would take every step: the run waits for min_workers, up to placement_timeout_s. Of 4 CPUs,
    one worker fits beside the server (and on a loaded machine may still be starting at the bound). 30 s: the bound
    is also the server's start (its restore), which on a machine running two test suites takes longer than 10 s."""
    with pytest.raises(RunFailed, match=r"only [01] of scaling.min_workers=2 workers asked for a step within "
                                        r"scaling.placement_timeout_s=30.0s \(each needs 2.0 CPU"):
        train(job("strategy.name=async_ps", "strategy.server_cpus=0.5", "scaling.cpus_per_worker=2",
                  "scaling.placement_timeout_s=30", name="ps-short"), run_dir=tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["status"] == "failed" and saved["final_step"] == 0


def replay(config, rows: list[dict]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The updates of an async run's history, in one process: update k's gradient is taken on its ticket's
    batch at the parameters the server served from version k - 1 - staleness (extrapolated by weight
    prediction's formula, written out here), then applied to version k - 1. The final parameters and each
    update's loss."""
    workload = load_workload(config.workload.name, config.workload.options)
    dataset = workload.train_dataset()
    order = GlobalSampleOrder(len(dataset), config.training.global_batch_size, config.training.seed)
    torch.manual_seed(config.training.seed)
    model = workload.build_model()
    optimizer = optimizer_factory(config.optim, None)(model)
    params = dict(model.named_parameters())
    versions = [{n: p.detach().clone() for n, p in params.items()}]
    s_hats, losses = [0.0], []
    for row in sorted(rows, key=lambda r: r["step"]):
        read = row["step"] - 1 - row["staleness"]
        s_hat, now = s_hats[read], versions[-1]
        served = {n: torch.lerp(versions[max(read - 1, 0)][n], versions[read][n], 1 + s_hat) for n in now}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(served[n] if s_hat else versions[read][n])
        indices = order.rank_indices(row["ticket"], 0, 1).tolist()
        inputs, targets = zip(*(dataset[i] for i in indices), strict=True)
        optimizer.zero_grad(set_to_none=True)
        loss = workload.training_step(model, (torch.stack(inputs), torch.as_tensor(targets)))
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(now[n])
        set_learning_rate(optimizer, learning_rate(row["step"] - 1, config.optim, config.training.steps))
        optimizer.step()
        versions.append({n: p.detach().clone() for n, p in params.items()})
        s_hats.append(s_hats[-1] + STALENESS_AVERAGING * (row["staleness"] - s_hats[-1]))
    return {n: p.detach() for n, p in model.state_dict().items()}, losses


@pytest.mark.usefixtures("ray_local")
def test_async_updates_are_the_replayed_stale_and_predicted_gradients(tmp_path):
    """Every update of a 3-worker run (one throttled) is the gradient of its ticket's batch at the (predicted)
    parameters its staleness says, applied in update order: a single-process replay of the history ends with the
    run's model. With one worker every gradient is fresh, nothing is extrapolated, and the run is DDP's, its batches
    fetched by data.num_workers loader processes or not."""
    settings = ("training.steps=24", "strategy.name=async_ps", "strategy.server_cpus=0.5", "optim.name=adamw")
    config = job(*settings, "scaling.min_workers=3", "scaling.max_workers=3",
                 "faults=[{action: throttle, rank: 2, step: 1, factor: 3.0}]",
                 name="ps-replay")  # the slow worker's gradients are stale
    result = train(config, run_dir=tmp_path / "three")
    ready = next(e for e in result.events if e.type == "workers_ready")  # all three before the first step
    assert ready.step == 0 and len(ready.details["workers"]) == 3
    assert result.final_step == 24 and any(row["staleness"] > 0 for row in result.history)
    replayed, losses = replay(config, result.history)
    assert_states_close(load_model(tmp_path / "three"), replayed)
    assert [row["loss"] for row in sorted(result.history, key=lambda r: r["step"])] == pytest.approx(losses, rel=1e-5)
    single = train(job(*settings, "scaling.min_workers=1", "scaling.max_workers=1", "data.num_workers=1",
                       name="ps-one"),
                   run_dir=tmp_path / "one")
    ddp = run_distributed(train_job_alone, 1, job("training.steps=24", "optim.name=adamw", name="ps-ddp-one"),
                          timeout_s=300)[0]  # DDP's one-rank run (test_elastic), in a process of its own
    assert all(row["staleness"] == 0 for row in single.history) and single.final_step == 24
    assert_states_close(load_model(tmp_path / "one"), ddp, rtol=0, atol=0)


@pytest.mark.usefixtures("ray_local")
def test_killed_and_stalled_workers_and_a_killed_server_are_survived_and_every_step_applied_once(tmp_path):
    steps = 120
    result = train(job(f"training.steps={steps}", "training.global_batch_size=64", "strategy.name=async_ps",
                       "strategy.num_servers=2", "strategy.server_cpus=0.5", "checkpoint.every_steps=25",
                       "training.record_samples=true", "failure.step_timeout_s=3",
                       "faults=[{action: kill, rank: 1, step: 30}, {action: kill_server, rank: 1, step: 70},"
                       " {action: stall, rank: 0, step: 100}]", name="ps-faults"), run_dir=tmp_path)
    assert result.final_step == steps and result.metrics["accuracy"] > 0.85
    failed = [e.details for e in result.events if e.type == "worker_failed"]
    assert failed[0]["worker"] == "raylastic:ps-faults:worker1.0"
    assert failed[1]["worker"] == "raylastic:ps-faults:worker0.0" and "no answer for 3s" in failed[1]["reason"]
    assert [e.type for e in result.events].count("worker_joined") == 2
    assert [e.details["server"] for e in result.events if e.type == "server_failed"] == [1]
    restored = [e for e in result.events if e.type == "generation_formed" and e.details["state_source"] == "checkpoint"]
    assert len(restored) == 1 and restored[0].step == 50                     # the newest checkpoint before update 70
    assert restored[0].details["steps_lost"] >= 69 - 50  # and what was admitted before the loss was noticed
    applied_tickets(result, steps)


@pytest.mark.usefixtures("ray_local")
def test_a_server_lost_at_the_last_update_brings_workers_back_for_the_steps_taken_back(tmp_path):
    """The last update admitted, the workers are told there are no more steps and leave; then the restore takes
    steps back: new workers must compute them."""
    result = train(job("training.steps=20", "strategy.name=async_ps", "strategy.server_cpus=0.5",
                       "checkpoint.every_steps=10", "faults=[{action: kill_server, rank: 0, step: 20}]",
                       name="ps-last"), run_dir=tmp_path)
    assert result.final_step == 20
    restored = [e for e in result.events if e.type == "generation_formed" and e.details["state_source"] == "checkpoint"]
    assert [e.step for e in restored] == [10]


@pytest.mark.usefixtures("ray_local")
def test_staleness_beyond_the_bound_never_reaches_the_parameters(tmp_path):
    result = train(job("training.steps=40", "strategy.name=async_ps", "strategy.max_staleness=0",
                       "strategy.server_cpus=0.5", "scaling.max_workers=3", "training.record_samples=true",
                       "faults=[{action: throttle, rank: 2, step: 1, factor: 4.0}]", name="ps-stale"), run_dir=tmp_path)
    assert result.final_step == 40
    assert result.metrics["refused_stale"] > 0                   # the slow worker's gradients come in late
    assert result.metrics["max_applied_staleness"] == 0          # the servers' own count of what they applied
    assert all(row["staleness"] == 0 for row in result.history)
    order = GlobalSampleOrder(DIGITS_TRAIN_SAMPLES, 48, 0)
    kept = sorted(a["samples"] for applications in result.ledger.values() for a in applications if a["kept"])
    assert kept == sorted(order.rank_indices(step, 0, 1).tolist() for step in range(40))


@pytest.mark.usefixtures("ray_local")
def test_an_emulated_link_delays_pulls_and_overlaps_pushes_with_the_next_step(tmp_path):
    result = train(job("training.steps=12", "strategy.name=async_ps", "strategy.server_cpus=0.5",
                       "scaling.min_workers=1", "scaling.max_workers=1", "link.bandwidth_gbit_s=0.01",
                       "link.latency_ms=2", name="ps-link"), run_dir=tmp_path)
    rows = result.history
    pull_s, push_s = (0.002 + rows[0][key] * 8 / 0.01e9 for key in ("bytes_received", "bytes_sent"))
    assert pull_s > 0.05 and push_s > 0.05                       # ~0.08 s each way for digits' 104 kB
    assert rows[0]["link_delay_s"] == pytest.approx(pull_s, abs=1e-4)   # the first push finds the link free
    for row in rows[1:]:  # later ones wait for the last push, less what the pull and the compute overlapped
        push_left_s = max(0.0, push_s - row["compute_s"][0])  # none after a compute as long as a push (under load)
        assert pull_s - 1e-4 <= row["link_delay_s"] <= pull_s + push_left_s + 0.01
    gaps = [b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:], strict=False)]
    assert min(gaps) >= max(pull_s, push_s) - 0.01                # one worker: no update sooner than the link allows


def test_async_settings_are_checked():
    with pytest.raises(ValueError, match="strategy.max_staleness"):
        load_job_config(None, ["strategy.name=async_ps", "strategy.max_staleness=-1"])
    with pytest.raises(ValueError, match=r"faults\[0\].rank.*below strategy.num_servers \(1\)"):
        load_job_config(None, ["strategy.name=async_ps", "faults=[{action: kill_server, rank: 1, step: 5}]"])
    with pytest.raises(ValueError, match="kill_server only with strategy.name=async_ps"):
        load_job_config(None, ["faults=[{action: kill_server, rank: 0, step: 5}]"])
    with pytest.raises(ValueError, match="scaling.spare_workers is not supported with strategy.name=async_ps"):
        load_job_config(None, ["strategy.name=async_ps", "scaling.spare_workers=1"])
    with pytest.raises(ValueError, match="strategy.predict_weights.*true or false"):
        load_job_config(None, ["strategy.name=async_ps", "strategy.predict_weights=sometimes"])

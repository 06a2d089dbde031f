"""The GPU path's decisions, without a GPU: which device a worker binds, how an NCCL generation is aborted, and
what every worker's environment holds (scaling.worker_env). The parts that need CUDA are in tests/test_gpu.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from raylastic.actors.processes.setup_hook import ROLE_VARIABLE, TRAINS, worker_runtime_env
from raylastic.actors.status.peer_loss import is_peer_loss
from raylastic.jobconfig import ScalingConfig
from raylastic.jobconfig.scaling import RESERVED_WORKER_ENV
from raylastic.strategies import process_group
from raylastic.strategies.device_binding import NOSET_VISIBLE_DEVICES, cuda_device_index
from raylastic.strategies.nccl_recovery import NCCL_RECOVERY_ENVIRONMENT, BoundedAbort, NcclWatch, abort_steps
from tests.support.helpers import job

UUIDS = "GPU-5d2f0e1a-0000-0000-0000-000000000001,GPU-5d2f0e1a-0000-0000-0000-000000000002"


@pytest.mark.parametrize(("assigned", "visible", "index"), [
    ([3], None, 3),                                    # the node's GPUs, none hidden: Ray's id is the index
    (["2"], "0,2,3", 1),                               # the node's raylet sees three of its GPUs
    (["0"], "0", 0),                                   # Ray narrowed the process to its own GPU (no NOSET)
    ([UUIDS.split(",")[1]], UUIDS, 1),                 # the node names its GPUs by UUID
    (["2"], " 0, 2 ,3", 1),
])
def test_a_worker_binds_the_position_of_its_assigned_gpu_among_those_it_sees(assigned, visible, index):
    assert cuda_device_index(assigned, visible) == index


def test_an_assigned_gpu_the_process_cannot_see_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"GPU '5'.*CUDA_VISIBLE_DEVICES='0,2,3'"):
        cuda_device_index(["5"], "0,2,3")
    with pytest.raises(ValueError, match=r"GPU '1'.*CUDA_VISIBLE_DEVICES=''"):
        cuda_device_index(["1"], "")
    with pytest.raises(ValueError, match=r"GPU 'GPU-5d2f.*no index.*unset"):
        cuda_device_index([UUIDS.split(",")[0]], None)
    with pytest.raises(ValueError, match=r"exactly one GPU.*\['0', '1'\]"):
        cuda_device_index(["0", "1"], "0,1")
    with pytest.raises(ValueError, match=r"exactly one GPU.*\[\]"):
        cuda_device_index([], None)


@pytest.mark.parametrize(("backend", "connections", "steps"), [
    ("gloo", True, ("shut_down_gloo_connections",)),
    ("gloo", False, ()),
    ("nccl", True, ("shut_down_gloo_connections", "abort_nccl_groups")),
    ("cpu:gloo,cuda:nccl", True, ("shut_down_gloo_connections", "abort_nccl_groups")),
    ("cpu:gloo,cuda:nccl", False, ("abort_nccl_groups",)),
])
def test_an_abort_shuts_down_the_gloo_connections_first_also_on_the_nccl_path(backend, connections, steps):
    assert abort_steps(backend, has_connections=connections) == steps


def test_an_abort_that_hangs_is_given_up_on_within_its_bound_and_joined_by_the_next_caller():
    release, calls = threading.Event(), []

    def abort() -> None:
        calls.append(1)
        release.wait(60)

    bounded = BoundedAbort(abort, timeout_s=0.2)
    started = time.monotonic()
    assert bounded.run() is False and bounded.in_flight
    assert time.monotonic() - started < 10  # the bound, plus any slack a loaded machine needs
    release.set()
    assert bounded.run() is True and not bounded.in_flight
    assert calls == [1]  # the second caller joined this generation's abort instead of starting another
    assert bounded.run() is True and calls == [1]
    bounded.forget()  # the next generation's groups
    assert not bounded.started
    assert bounded.run() is True and calls == [1, 1]


def test_a_step_whose_generation_was_aborted_is_discarded_as_a_peer_loss(monkeypatch):
    """A collective our abort ended may return as if it had completed (NCCL, TORCH_NCCL_ASYNC_ERROR_HANDLING=0): the
    step checks before its optimizer steps, and its error is a peer loss, so the survivors re-form."""
    monkeypatch.setattr(process_group, "_nccl_abort", BoundedAbort(lambda: None, timeout_s=10))
    process_group.raise_if_aborted()  # nothing aborted
    assert process_group._nccl_abort.run() is True
    with pytest.raises(torch.distributed.DistError, match="aborted") as aborted:
        process_group.raise_if_aborted()
    assert is_peer_loss(aborted.value)


def test_an_abort_that_raises_has_returned():
    def abort() -> None:
        raise ValueError("Invalid process group specified or has been destroyed.")

    assert BoundedAbort(abort, timeout_s=10).run() is True


def test_the_watch_aborts_once_on_the_first_error_torch_records():
    readings = iter([[], RuntimeError("a group being made"), ["TIMEOUT"], ["TIMEOUT", "COMM_ERROR"]])

    def read_errors() -> list[str]:
        reading = next(readings, [])
        if isinstance(reading, Exception):
            raise reading
        return reading

    reported: list[str] = []
    done = threading.Event()
    watch = NcclWatch(read_errors=read_errors, on_error=lambda errors: (reported.append(errors), done.set()),
                      period_s=0.01).start()
    assert done.wait(30)
    time.sleep(0.1)
    watch.stop()
    assert reported == ["TIMEOUT"]


def test_a_stopped_watch_reports_nothing():
    reported: list[str] = []
    watch = NcclWatch(read_errors=lambda: ["TIMEOUT"], on_error=reported.append, period_s=0.01).start()
    watch.stop()
    time.sleep(0.2)  # twenty periods
    assert reported == []


def test_worker_env_reaches_the_workers_runtime_environment_beside_ours():
    gpu = worker_runtime_env(ScalingConfig(use_gpu=True, worker_env={"NCCL_DEBUG": "INFO",
                                                                     "NCCL_SOCKET_IFNAME": "eth0"}))
    assert gpu == {"env_vars": {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", NOSET_VISIBLE_DEVICES: "1",
                                ROLE_VARIABLE: "trains"}}
    assert worker_runtime_env(ScalingConfig()) == TRAINS  # CPU workers: as before
    assert job("scaling.worker_env={NCCL_DEBUG: INFO}").scaling.worker_env == {"NCCL_DEBUG": "INFO"}


@pytest.mark.parametrize(("worker_env", "message"), [
    ({"nccl_debug": "INFO"}, r"scaling\.worker_env must be a mapping of variable name \(\[A-Z_\]"),
    ({"1NCCL": "INFO"}, r"scaling\.worker_env must be"),
    ({"NCCL_IB_TIMEOUT": 22}, r"scaling\.worker_env must be .* to a string value, got \{'NCCL_IB_TIMEOUT': 22\}"),
    (["NCCL_DEBUG=INFO"], r"scaling\.worker_env must be a mapping"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_DEBUG": "INFO"},
     r"scaling\.worker_env cannot set TORCH_NCCL_ASYNC_ERROR_HANDLING: raylastic sets"),
    ({NOSET_VISIBLE_DEVICES: "0", ROLE_VARIABLE: "x"},
     rf"cannot set {ROLE_VARIABLE}, {NOSET_VISIBLE_DEVICES}:"),
])
def test_worker_env_is_refused_naming_the_field(worker_env, message):
    with pytest.raises(ValueError, match=message):
        ScalingConfig(worker_env=worker_env)


def test_the_variables_we_set_in_workers_are_reserved():
    assert set(NCCL_RECOVERY_ENVIRONMENT) | {NOSET_VISIBLE_DEVICES, ROLE_VARIABLE} == set(RESERVED_WORKER_ENV)

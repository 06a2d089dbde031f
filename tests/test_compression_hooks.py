"""Compression comm hooks against their naive references, at world size 2 and 3, and through DDP.

Each spawned group runs every check it can at once (a group costs seconds on this machine);
the ranks return their tensors and the assertions run here, against references computed from
the same seeded gradients. Run: ``pytest tests/test_compression_hooks.py``.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from raylastic.strategies.compression import COMPRESSION_KINDS, CompressionOptions, make_comm_hook
from raylastic.strategies.compression.accounting import CommTraffic, HookState, UncompressedTraffic
from raylastic.strategies.compression.int8 import reference_int8_mean
from raylastic.strategies.compression.lowp import reference_low_precision_mean
from raylastic.strategies.compression.onebit import pack_signs, reference_onebit_mean, unpack_signs
from raylastic.strategies.compression.powersgd import reference_powersgd_mean
from raylastic.strategies.compression.topk import reference_topk_mean
from raylastic.strategies.ddp import DDPStrategy
from tests.support.distributed_harness import FakeBucket, run_distributed

SMALL = [[(30, 20)], [(43,)]]  # two buckets (indices 0, 1) per step; 43 is not a multiple of 8
BIG = [[(256, 256), (256,)]]  # one bucket: a 256x256 layer and its bias
UNIT_OPTIONS = CompressionOptions(powersgd_rank=4, powersgd_start_iter=2, topk_fraction=0.05, onebit_warmup_steps=2)
RATIO_OPTIONS = CompressionOptions(powersgd_start_iter=2, topk_fraction=0.01, onebit_warmup_steps=0)
UNIT_STEPS = {"none": 1, "fp16": 1, "bf16": 1, "int8": 2, "topk": 4, "onebit": 5, "powersgd": 4}


def gradient(rank: int, step: int, bucket: int, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * bucket + rank)
    return torch.randn(numel, generator=generator) * (1 + rank)


def numels(buckets: list[list[tuple[int, ...]]]) -> list[int]:
    return [sum(math.prod(shape) for shape in shapes) for shapes in buckets]


def _run_hook(kind: str, buckets: list, steps: int, options: CompressionOptions) -> dict:
    """Drive one hook over ``steps`` iterations of fake buckets (index 0 first, as DDP does)."""
    rank = dist.get_rank()
    state, hook = make_comm_hook(kind, options=options)
    parameters = [[torch.zeros(shape) for shape in shapes] for shapes in buckets]
    outputs, residuals, sent = [], [], []
    for step in range(steps):
        step_outputs, step_residuals = {}, {}
        for index in range(len(buckets)):
            numel = sum(p.numel() for p in parameters[index])
            bucket = FakeBucket(index, parameters[index], gradient(rank, step, index, numel), bucket_count=len(buckets))
            step_outputs[index] = hook(state, bucket).wait().clone()
            if hasattr(state, "error_feedback"):
                step_residuals[index] = state.error_feedback.compensate(bucket, torch.zeros(numel))
            elif kind == "powersgd" and index in state.powersgd.error_dict:
                step_residuals[index] = state.powersgd.error_dict[index].clone()
        outputs.append(step_outputs)
        residuals.append(step_residuals)
        sent.append(state.take_traffic())
    return {"outputs": outputs, "residuals": residuals, "traffic": sent, "steps": state.steps}


def _compressor_checks() -> dict:
    unit = {kind: _run_hook(kind, BIG if kind == "powersgd" else SMALL, UNIT_STEPS[kind], UNIT_OPTIONS)
            for kind in COMPRESSION_KINDS}
    ratio_steps = {"powersgd": 3}
    ratios = {kind: _run_hook(kind, BIG, ratio_steps.get(kind, 1), RATIO_OPTIONS)["traffic"][-1]
              for kind in COMPRESSION_KINDS}
    return {"unit": unit, "ratios": ratios}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def runs(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(_compressor_checks, request.param, timeout_s=120)


def per_rank_grads(world_size: int, step: int, bucket: int, numel: int) -> list[torch.Tensor]:
    return [gradient(rank, step, bucket, numel) for rank in range(world_size)]


def unit(results: list[dict], kind: str, rank: int = 0) -> dict:
    return results[rank]["unit"][kind]


def test_every_rank_gets_the_same_gradient(runs):
    world_size, results = runs
    for kind in COMPRESSION_KINDS:
        for step, outputs in enumerate(unit(results, kind)["outputs"]):
            for index, output in outputs.items():
                for rank in range(1, world_size):
                    other = unit(results, kind, rank)["outputs"][step][index]
                    assert torch.equal(output, other), f"{kind} step {step} bucket {index}: rank {rank} differs"


def test_uncompressed_and_half_precision_hooks(runs):
    world_size, results = runs
    tolerances = {"none": (None, 1e-6), "fp16": (torch.float16, 2e-3), "bf16": (torch.bfloat16, 2e-2)}
    for kind, (dtype, tolerance) in tolerances.items():
        for index, numel in enumerate(numels(SMALL)):
            grads = per_rank_grads(world_size, 0, index, numel)
            output = unit(results, kind)["outputs"][0][index]
            torch.testing.assert_close(output, reference_low_precision_mean(grads, dtype), rtol=tolerance,
                                       atol=tolerance)
            torch.testing.assert_close(output, sum(grads) / world_size, rtol=4 * tolerance, atol=4 * tolerance)


def test_int8_is_within_quantization_error(runs):
    world_size, results = runs
    for step in range(UNIT_STEPS["int8"]):
        for index, numel in enumerate(numels(SMALL)):
            grads = per_rank_grads(world_size, step, index, numel)
            output = unit(results, "int8")["outputs"][step][index]
            expected, bound = reference_int8_mean(grads)
            torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
            assert (output - sum(grads) / world_size).abs().max() <= bound * (1 + 1e-5)


def test_topk_keeps_the_k_largest_and_matches_the_reference(runs):
    world_size, results = runs
    for index, numel in enumerate(numels(SMALL)):
        k = math.ceil(UNIT_OPTIONS.topk_fraction * numel)
        residuals = [torch.zeros(numel) for _ in range(world_size)]
        for step in range(UNIT_STEPS["topk"]):
            grads = per_rank_grads(world_size, step, index, numel)
            compensated = [g + r for g, r in zip(grads, residuals, strict=True)]
            expected, residuals = reference_topk_mean(grads, residuals, k)
            torch.testing.assert_close(unit(results, "topk")["outputs"][step][index], expected)
            for rank in range(world_size):
                residual = unit(results, "topk", rank)["residuals"][step][index]
                torch.testing.assert_close(residual, residuals[rank])
                sent = compensated[rank] - residual
                assert int((sent != 0).sum()) == k
                assert sent[sent != 0].abs().min() >= residual.abs().max()


def _assert_error_feedback_conserves(kind: str, world_size: int, results: list[dict], steps: int) -> None:
    """What was applied (N x the mean, summed over steps) plus every rank's final residual is every gradient."""
    for index, numel in enumerate(numels(SMALL)):
        applied = sum(unit(results, kind)["outputs"][step][index] for step in range(steps)) * world_size
        left = sum(unit(results, kind, rank)["residuals"][steps - 1][index] for rank in range(world_size))
        true = sum(sum(per_rank_grads(world_size, step, index, numel)) for step in range(steps))
        torch.testing.assert_close(applied + left, true, rtol=1e-5, atol=1e-4)


def test_topk_error_feedback_loses_nothing(runs):
    world_size, results = runs
    _assert_error_feedback_conserves("topk", world_size, results, UNIT_STEPS["topk"])


def test_onebit_is_exact_during_warmup_then_matches_the_reference(runs):
    world_size, results = runs
    warmup = UNIT_OPTIONS.onebit_warmup_steps
    assert unit(results, "onebit")["steps"] == UNIT_STEPS["onebit"]  # two buckets per step, one step counted
    for index, numel in enumerate(numels(SMALL)):
        residuals = [torch.zeros(numel) for _ in range(world_size)]
        for step in range(UNIT_STEPS["onebit"]):
            grads = per_rank_grads(world_size, step, index, numel)
            output = unit(results, "onebit")["outputs"][step][index]
            if step < warmup:
                torch.testing.assert_close(output, sum(grads) / world_size)
                assert unit(results, "onebit")["traffic"][step].bytes_sent == 4 * sum(numels(SMALL))
                continue
            expected, residuals = reference_onebit_mean(grads, residuals)
            torch.testing.assert_close(output, expected)
            for rank in range(world_size):
                torch.testing.assert_close(unit(results, "onebit", rank)["residuals"][step][index], residuals[rank])
        compressed = unit(results, "onebit")["traffic"][-1].bytes_sent
        assert compressed == sum(math.ceil(n / 8) + 4 for n in numels(SMALL))
    _assert_error_feedback_conserves("onebit", world_size, results, UNIT_STEPS["onebit"])


def test_powersgd_is_exact_before_start_iter_then_matches_the_reference(runs):
    world_size, results = runs
    start, rank_r = UNIT_OPTIONS.powersgd_start_iter, UNIT_OPTIONS.powersgd_rank
    (numel,) = numels(BIG)
    for step in range(start + 1):
        grads = per_rank_grads(world_size, step, 0, numel)
        output = unit(results, "powersgd")["outputs"][step][0]
        if step < start:
            torch.testing.assert_close(output, sum(grads) / world_size)
            assert unit(results, "powersgd")["traffic"][step].bytes_sent == 4 * numel
            continue
        # torch draws the first Q from its numpy RNG (seed 0) the first time the bucket is compressed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(np.random.RandomState(0).randint(1_000_000_000))
            q = torch.randn(1, 256, rank_r)[0]
        matrices = [g[: 256 * 256].view(256, 256) for g in grads]
        torch.testing.assert_close(output[: 256 * 256].view(256, 256), reference_powersgd_mean(matrices, q),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(output[256 * 256:], sum(g[256 * 256:] for g in grads) / world_size)
        for rank in range(world_size):  # the error of the first compressed step is input - approximation
            residual = unit(results, "powersgd", rank)["residuals"][step][0]
            torch.testing.assert_close(residual, grads[rank] - output)
    assert unit(results, "powersgd")["traffic"][start].bytes_sent == 4 * ((256 + 256) * rank_r + 256)


def test_byte_ratios(runs):
    _, results = runs
    ratios = {kind: traffic.uncompressed_bytes / traffic.bytes_sent for kind, traffic in results[0]["ratios"].items()}
    print("compression ratios (256x256 layer + bias):", {k: round(v, 2) for k, v in ratios.items()})
    assert ratios["none"] == 1
    assert ratios["fp16"] == ratios["bf16"] == 2
    assert 3.9 < ratios["int8"] <= 4
    assert ratios["topk"] >= 45  # 8 bytes per kept element instead of 4 per element: 50x at 1%
    assert ratios["onebit"] >= 30
    assert ratios["powersgd"] >= 25  # (256 + 256) x 4 numbers + the bias instead of 256 x 256


# --- no process group needed -------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 643])
def test_sign_packing_round_trips(numel):
    values = torch.randn(numel)
    values[0] = 0.0  # zero counts as positive
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 8)
    assert torch.equal(unpack_signs(packed, numel, torch.float32), torch.where(values >= 0, 1.0, -1.0))


def test_reference_topk_on_a_known_tensor():
    grads = [torch.tensor([0.1, -3.0, 2.0, 0.5]), torch.tensor([1.0, 0.0, -0.2, -4.0])]
    residuals = [torch.tensor([0.0, 0.0, 0.0, 1.0]), torch.zeros(4)]
    mean, new_residuals = reference_topk_mean(grads, residuals, 2)
    torch.testing.assert_close(mean, torch.tensor([0.5, -1.5, 1.0, -2.0]))
    torch.testing.assert_close(new_residuals[0], torch.tensor([0.1, 0.0, 0.0, 1.5]))
    torch.testing.assert_close(new_residuals[1], torch.tensor([0.0, 0.0, -0.2, 0.0]))


def test_take_bytes_sent_returns_the_count_since_the_last_take():
    state = HookState()
    bucket = FakeBucket(0, [torch.zeros(10)], torch.zeros(10))
    state.record(bucket, 5)
    state.record(bucket, 5)
    assert state.take_bytes_sent() == 10 and state.take_bytes_sent() == 0
    state.record(bucket, 3)
    assert state.take_traffic() == CommTraffic(bytes_sent=3, uncompressed_bytes=40)
    assert (state.bytes_sent, state.uncompressed_bytes) == (13, 120)  # cumulative


def test_unknown_kind_lists_the_kinds():
    with pytest.raises(ValueError, match="powersgd"):
        make_comm_hook("zip")  # type: ignore[arg-type]


# --- through a real DDP model --------------------------------------------------------------------------

DDP_STEPS = 5
DDP_OPTIONS = CompressionOptions(powersgd_rank=2, powersgd_start_iter=2, topk_fraction=0.1, onebit_warmup_steps=2)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def _probe(inner, log: list):
    """Wrap ``inner`` to log each bucket's layout; the parameter must be named ``bucket`` for DDP."""

    def probe_hook(state, bucket):
        start = bucket.buffer().storage_offset()
        log.append({"index": bucket.index(), "is_last": bucket.is_last(), "numel": bucket.buffer().numel(),
                    "parameter_numels": [p.numel() for p in bucket.parameters()],
                    "offsets": [g.storage_offset() - start for g in bucket.gradients()]})
        return inner(state, bucket)

    return probe_hook


def _ddp_checks() -> dict:
    """Each kind (and no hook) trains the same MLP for DDP_STEPS steps of two micro-batches (no_sync)."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randn(DDP_STEPS, 2, 6, 8, generator=generator)
    targets = torch.randn(DDP_STEPS, 2, 6, 4, generator=generator)
    results = {}
    for kind in ("no hook", *COMPRESSION_KINDS):
        model = _model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.002, init_sync=False)  # ~500 floats per bucket
        log: list = []
        hook = None if kind == "no hook" else make_comm_hook(kind, options=DDP_OPTIONS)
        if hook is not None:
            ddp.register_comm_hook(hook.state, _probe(hook.hook, log))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        params, sent = [], []
        for step in range(DDP_STEPS):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    F.mse_loss(ddp(inputs[step, micro]), targets[step, micro]).backward()
            optimizer.step()
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            sent.append(hook.state.take_bytes_sent() if hook else UncompressedTraffic(model).take_traffic().bytes_sent)
        results[kind] = {"params": params, "sent": sent, "log": log, "steps": hook.state.steps if hook else None}
    results["strategy hooks"] = {timed: _strategy_hooks(DDPStrategy(comm_timing=timed)) for timed in (False, True)}
    return results


def _strategy_hooks(strategy: DDPStrategy) -> dict:
    """What DDPStrategy registers on its DDP: the Python hooks, and what counts bytes and times buckets."""
    state = strategy.setup(_model, lambda model: torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), None)
    return {"python_hooks": len(state.wrapped._comm_hooks), "traffic": type(state.comm.state).__name__,
            "timed": state.comm.timer is not None}


@pytest.fixture(scope="module")
def ddp_runs() -> list[dict]:
    return run_distributed(_ddp_checks, 2, timeout_s=120)


def test_uncompressed_hook_equals_no_hook(ddp_runs):
    for rank_results in ddp_runs:
        for with_hook, without in zip(rank_results["none"]["params"], rank_results["no hook"]["params"], strict=True):
            assert torch.equal(with_hook, without)


def test_untimed_uncompressed_ddp_runs_no_python_hook_and_counts_what_the_hook_counts(ddp_runs):
    untimed, timed = ddp_runs[0]["strategy hooks"][False], ddp_runs[0]["strategy hooks"][True]
    assert untimed == {"python_hooks": 0, "traffic": "UncompressedTraffic", "timed": False}
    assert timed["python_hooks"] == 1 and timed["timed"]
    assert ddp_runs[0]["no hook"]["sent"] == ddp_runs[0]["none"]["sent"]  # every gradient once per step


def test_every_kind_trains_through_ddp_with_accumulation(ddp_runs):
    total = sum(p.numel() for p in _model().parameters())
    for kind in COMPRESSION_KINDS:
        run = ddp_runs[0][kind]
        assert run["steps"] == DDP_STEPS  # the no_sync micro-batch never reaches the hook
        assert all(torch.isfinite(p).all() for p in run["params"]), kind
        assert all(s > 0 for s in run["sent"]), kind
        assert torch.equal(run["params"][-1], ddp_runs[1][kind]["params"][-1]), f"{kind}: replicas differ"
        assert all(sum(b["numel"] for b in iteration) == total for iteration in iterations(run["log"])), kind
    assert ddp_runs[0]["none"]["sent"] == [4 * total] * DDP_STEPS


def test_hooks_with_a_full_precision_start_match_no_hook_until_they_compress(ddp_runs):
    reference = ddp_runs[0]["no hook"]["params"]
    full_precision_steps = {"powersgd": DDP_OPTIONS.powersgd_start_iter, "onebit": DDP_OPTIONS.onebit_warmup_steps}
    for kind, exact_steps in full_precision_steps.items():
        run = ddp_runs[0][kind]
        for step in range(exact_steps):
            assert torch.equal(run["params"][step], reference[step]), f"{kind} step {step}"
        assert run["sent"][exact_steps] < run["sent"][0] / 2, kind
    for kind, tolerance in (("fp16", 1e-3), ("bf16", 1e-2), ("int8", 1e-2)):
        torch.testing.assert_close(ddp_runs[0][kind]["params"][-1], reference[-1], rtol=tolerance, atol=tolerance)


def iterations(log: list[dict]) -> list[list[dict]]:
    """The probe's log split into iterations: DDP runs buckets 0, 1, ..., the last one ends it."""
    split, current = [], []
    for entry in log:
        assert entry["index"] == len(current), "buckets out of order"
        current.append(entry)
        if entry["is_last"]:
            split.append(current)
            current = []
    assert not current
    return split


def test_ddp_buckets_are_rebuilt_after_the_first_step_and_laid_out_in_parameter_order(ddp_runs):
    """Why error feedback is keyed by parameter: the first iteration's single bucket is split after it."""
    log = ddp_runs[0]["topk"]["log"]
    per_iteration = [len(iteration) for iteration in iterations(log)]
    assert per_iteration[0] == 1 and all(n >= 2 for n in per_iteration[1:]), per_iteration
    for entry in log:
        offsets = [sum(entry["parameter_numels"][:i]) for i in range(len(entry["parameter_numels"]))]
        assert entry["offsets"] == offsets and sum(entry["parameter_numels"]) == entry["numel"]

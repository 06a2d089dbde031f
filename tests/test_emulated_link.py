"""The emulated slow link (``link:``, strategies/emulated_link.py): its delay, its config, and a real run on a
local Ray whose steps take longer by that delay and train exactly the same parameters.

    python -m pytest tests/test_emulated_link.py -q
"""

from __future__ import annotations

import statistics

import pytest
import torch

from raylastic.cluster.job import train
from raylastic.jobconfig import LinkConfig, load_job_config
from raylastic.strategies.emulated_link import EmulatedLink
from tests.support.helpers import job, load_model


def test_delay_is_latency_per_message_plus_bytes_over_bandwidth():
    link = EmulatedLink(bandwidth_gbit_s=1.0, latency_ms=5.0)
    assert link.delay_s(125_000_000, messages=1) == pytest.approx(1.005)  # 10^9 bits at 1 Gbit/s, + 5 ms
    assert link.delay_s(1_250_000, messages=2) == pytest.approx(0.02)
    assert link.delay_s(0, messages=0) == 0.0
    assert EmulatedLink(latency_ms=20.0).delay_s(10**12, messages=1) == pytest.approx(0.02)  # bandwidth unlimited
    assert EmulatedLink(bandwidth_gbit_s=0.5).delay_s(125_000_000, messages=3) == pytest.approx(2.0)


def test_the_link_is_off_by_default_and_outside_the_math():
    plain = load_job_config(None, [])
    assert plain.link == LinkConfig() and EmulatedLink.of(plain.link) is None
    slow = load_job_config(None, ["link.bandwidth_gbit_s=1", "link.latency_ms=5"])
    assert slow.link.bandwidth_gbit_s == 1.0 and isinstance(slow.link.bandwidth_gbit_s, float)
    assert EmulatedLink.of(slow.link) == EmulatedLink(bandwidth_gbit_s=1.0, latency_ms=5.0)
    assert EmulatedLink.of(LinkConfig(latency_ms=1.0)) == EmulatedLink(latency_ms=1.0)
    assert slow.math_hash() == plain.math_hash()  # a checkpoint resumes across links


@pytest.mark.parametrize(("overrides", "fragments"), [
    (["link.bandwidth_gbit_s=0"], ["link.bandwidth_gbit_s", "null or a positive number of Gbit/s", "0"]),
    (["link.bandwidth_gbit_s=-1"], ["link.bandwidth_gbit_s", "positive"]),
    (["link.bandwidth_gbit_s=fast"], ["link.bandwidth_gbit_s", "'fast'"]),
    (["link.bandwidth_gbit_s=true"], ["link.bandwidth_gbit_s", "True"]),
    (["link.latency_ms=-1"], ["link.latency_ms", "milliseconds in [0, 60000]"]),
    (["link.latency_ms=1e6"], ["link.latency_ms", "milliseconds in [0, 60000]"]),
    (["link.delay_ms=5"], ["unknown key link.delay_ms", "bandwidth_gbit_s, latency_ms"]),
])
def test_bad_link_values_name_the_field(overrides, fragments):
    with pytest.raises(ValueError) as raised:
        load_job_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(raised.value), str(raised.value)


@pytest.mark.usefixtures("ray_local")
def test_a_slow_link_makes_steps_longer_and_trains_the_same_parameters(tmp_path):
    base = ["scaling.balance=off"]  # equal shares in both runs: the same float operations, bit for bit
    plain = train(job(*base, name="link-plain"), run_dir=tmp_path / "plain")
    slow = train(job(*base, "link.bandwidth_gbit_s=0.01", "link.latency_ms=20", name="link-slow"),
                 run_dir=tmp_path / "slow")

    per_rank_bytes = slow.history[0]["bytes_sent"] // slow.history[0]["world_size"]
    expected = EmulatedLink(bandwidth_gbit_s=0.01, latency_ms=20.0).delay_s(per_rank_bytes, messages=1)
    assert expected > 0.08  # ~0.1 s: 26k float32 gradients at 10 Mbit/s, + 20 ms
    assert all(row["link_delay_s"] == pytest.approx(expected, abs=1e-5) for row in slow.history)
    assert all(row["step_s"] >= row["link_delay_s"] for row in slow.history)  # the delay is inside the step
    assert "link_delay_s" not in plain.history[0]
    def median_step_s(result) -> float:
        return statistics.median(row["step_s"] for row in result.history)

    longer = median_step_s(slow) - median_step_s(plain)
    assert longer > 0.8 * expected, (longer, expected)

    assert [r["loss"] for r in slow.history] == [r["loss"] for r in plain.history]
    slow_model, plain_model = load_model(tmp_path / "slow"), load_model(tmp_path / "plain")
    assert slow_model.keys() == plain_model.keys()
    assert all(torch.equal(slow_model[key], plain_model[key]) for key in plain_model)

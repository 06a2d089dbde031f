"""Small helpers shared by the tests that run real jobs."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.loading import load_job_config


def job(*overrides: str, name: str = "t"):
    """A short job config: the given ``--set`` style overrides over small, fast defaults."""
    base = [f"name={name}", "training.steps=20", "training.global_batch_size=48", "scaling.cpus_per_worker=0.5",
            "failure.collective_timeout_s=20"]
    return load_job_config(None, base + list(overrides))


def load_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


def assert_states_close(first: dict, second: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")

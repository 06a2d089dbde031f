"""cluster.yaml and examples/cluster-local.yaml pass Ray's own cluster-config validation and say what they must.

Ray's ``prepare_config`` + ``validate_config`` are what ``ray up`` runs on a config before it talks to
the cloud (defaults filled in, then the JSON schema). No cluster and no Ray instance is started.

    python -m pytest tests/test_cluster_config.py -q
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["cluster.yaml", "examples/cluster-local.yaml"]


def _load(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / name).read_text())


def _validated(config: dict) -> dict:
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.mark.parametrize("name", CONFIGS)
def test_config_passes_rays_validation(name: str) -> None:
    prepared = _validated(_load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_puts_this_repository_on_the_nodes_and_installs_it(name: str) -> None:
    prepared = _validated(_load(name))
    assert prepared["file_mounts"]["~/raylastic"] == "."
    assert ".venv" in prepared["rsync_exclude"]  # the 2 GB local virtualenv must not be copied
    for commands in (prepared["head_setup_commands"], prepared["worker_setup_commands"]):
        assert any("pip install -q -e ~/raylastic" in c for c in commands)
    readme_torch = re.search(r"torch==([\d.]+)", (REPO_ROOT / "README.md").read_text()).group(1)
    assert any(f"torch=={readme_torch}" in c for c in prepared["setup_commands"])


@pytest.mark.parametrize("name", CONFIGS)
def test_config_starts_ray_with_token_auth_a_loopback_dashboard_and_workers_at_normal_priority(name: str) -> None:
    prepared = _validated(_load(name))
    assert prepared["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    head_start = " ".join(prepared["head_start_ray_commands"])
    worker_start = " ".join(prepared["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert "RAY_worker_niceness=0" in head_start and "RAY_worker_niceness=0" in worker_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head_start
    assert "--metrics-export-port=8080" in head_start and "--metrics-export-port=8080" in worker_start
    # a job's supervisor, on any node, gives a stopped run time to save its step (Ray's default: 3 s)
    assert "RAY_JOB_STOP_WAIT_TIME_S=60" in head_start and "RAY_JOB_STOP_WAIT_TIME_S=60" in worker_start


def test_cluster_yaml_has_an_elastic_gpu_worker_type() -> None:
    prepared = _validated(_load("cluster.yaml"))
    workers = {name: t for name, t in prepared["available_node_types"].items() if name != prepared["head_node_type"]}
    gpu_types = [t for t in workers.values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu_types, workers
    assert all(t["min_workers"] == 0 < t["max_workers"] <= prepared["max_workers"] for t in gpu_types)
    assert prepared["idle_timeout_minutes"] > 0  # idle GPU nodes are handed back


def test_validation_rejects_a_broken_config() -> None:
    """The check is not vacuous: a misspelt key or a wrong type fails it, as ``ray up`` would."""
    misspelt = _load("cluster.yaml")
    misspelt["available_node_types"]["gpu_worker"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError):
        _validated(misspelt)
    wrong_type = _load("cluster.yaml")
    wrong_type["idle_timeout_minutes"] = "five"
    with pytest.raises(jsonschema.ValidationError):
        _validated(wrong_type)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_commands_in_the_comments_name_files_that_exist(name: str) -> None:
    text = (REPO_ROOT / name).read_text()
    assert f"ray up {name}" in text and f"ray submit {name} cluster/entry.py -- train" in text
    for path in set(re.findall(r"(?:cluster|examples)/[\w-]+\.(?:py|yaml)", text)):
        assert (REPO_ROOT / path).is_file(), path

"""Processes started ahead: ``WarmProcesses`` asks a node's raylet to start a process for the job before the
next worker is placed there (the setup hook, actors/processes/setup_hook.py, imports the training modules into
it)."""

from __future__ import annotations

import logging

import ray

from raylastic.actors.processes.setup_hook import KEEP_ALIVE_S

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0


class WarmProcesses:
    """Keeps a process started ahead on the nodes where this run's workers start.

    Ray's PrestartWorkers has no public API, so this calls the raylet's RPC; where that fails (an older or newer
    Ray, a network policy), it says so once and workers start cold, as without it."""

    def __init__(self, *, keep_alive_s: int = KEEP_ALIVE_S) -> None:
        self.keep_alive_s = keep_alive_s
        self._job_id = bytes.fromhex(ray.get_runtime_context().get_job_id())
        self._raylets: dict[str, object] = {}
        self._failed = False

    def top_up(self, node_ids: set[str], runtime_env: str | None = None) -> None:
        """Workers in ``runtime_env`` (ProcessStart.runtime_env; None: this process's) just started on
        ``node_ids``: start one more process in it on each, for the next worker there."""
        runtime_env = runtime_env if runtime_env is not None else ray.get_runtime_context().get_runtime_env_string()
        for node_id in node_ids:
            if self._failed:
                return
            try:
                self._raylet(node_id).PrestartWorkers(self._request(runtime_env), timeout=RPC_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - an optimisation: without it, workers start cold
                self._failed = True
                logger.warning("cannot start warm processes for new workers (%s: %s); they will start cold",
                               type(error).__name__, error)

    def _request(self, runtime_env: str) -> object:
        from ray.core.generated import common_pb2, node_manager_pb2, runtime_environment_pb2
        return node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, job_id=self._job_id, num_workers=1, keep_alive_duration_secs=self.keep_alive_s,
            runtime_env_info=runtime_environment_pb2.RuntimeEnvInfo(serialized_runtime_env=runtime_env))

    def _raylet(self, node_id: str) -> object:
        if node_id not in self._raylets:
            from ray._private.grpc_utils import init_grpc_channel
            from ray.core.generated.node_manager_pb2_grpc import NodeManagerServiceStub
            node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
            address = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
            self._raylets[node_id] = NodeManagerServiceStub(init_grpc_channel(address))
        return self._raylets[node_id]

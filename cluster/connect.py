"""Connect to Ray: a running cluster by address, or a local instance this process starts and stops.

Laptop mode: a head on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head ...``) then
``--address auto``; or no address at all, and a local instance is started for the run (no dashboard, so no job
server either) and shut down after it. Either instance, and the runs' process groups, listen on loopback only
(cluster/loopback.py): a job that joins an instance whose GCS answers on this machine's loopback only tells
its ranks' gloo and NCCL the loopback interface too. A head on the network address is a cluster: other
machines may join it while a run trains, so its ranks listen on the network.

Token authentication (Ray 2.60 turns it on for ``ray start --head`` and local ``ray.init``): Ray
sends the local token (``~/.ray/auth_token``) only to a cluster it finds itself, i.e. ``auto``
with no ``RAY_ADDRESS`` set. An explicit address of *this* machine - or ``RAY_ADDRESS``, which
``ray job submit`` sets for the job's driver - would then fail after ~20 s with "Authentication
token is missing". For such local addresses we enable token auth too; a remote cluster still
needs ``RAY_AUTH_MODE=token`` and its token, and the error says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import warnings
from collections.abc import Iterator

import ray

from raylastic.cluster.import_path import IMPORT_PATH_VARIABLE, SETUP_HOOK
from raylastic.cluster.local_start import start_local_ray
from raylastic.cluster.loopback import (
    is_loopback,
    is_loopback_only,
    loopback_interfaces,
    loopback_node,
    nodes_off_loopback,
)
from raylastic.jobconfig.naming import NAMESPACE


def job_runtime_env(*paths: str) -> dict:
    """The runtime environment of a job this process starts: workers import user workloads
    ("mypkg.model:Name") from ``paths`` (default: where the user ran the command), placed after the
    standard library (cluster/import_path.py), and every process Ray starts for the job imports the
    training modules first (actors/processes/setup_hook.py). This process's PYTHONPATH goes with it, less ``paths``."""
    directories = [os.path.abspath(path) for path in (paths or (os.getcwd(),))]
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if entry and os.path.abspath(entry) not in directories]
    return {"env_vars": {IMPORT_PATH_VARIABLE: os.pathsep.join(directories), "PYTHONPATH": os.pathsep.join(inherited)},
            "worker_process_setup_hook": SETUP_HOOK}


@contextlib.contextmanager
def ray_session(address: str | None = None, *, min_cpus: float = 0.0) -> Iterator[None]:
    """Use the Ray this process is already connected to, or the cluster at ``address`` (default:
    ``RAY_ADDRESS``), or else start a local instance for the block.

    A local instance gets ``max(os.cpu_count(), min_cpus)`` logical CPUs, so a job asking for
    more workers than there are cores still places them (they then share the cores).
    """
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")  # as ray.init does; a job's driver has it set
    options = dict(namespace=NAMESPACE, runtime_env=job_runtime_env(), log_to_driver=True,
                   logging_level=logging.WARNING, configure_logging=True)
    if address:
        _connect(address, options)
    else:
        # "local": a new instance even if `ray start` left one on this machine (ray.init's default
        # would connect to that one, and then refuses num_cpus).
        # worker_niceness 0: Ray's workers (ours: the training ranks) at normal CPU priority, without
        # root; see actors/processes/priority.py.
        # Reachable from this machine only: Ray's services, gloo and NCCL on loopback (cluster/loopback.py).
        options["runtime_env"]["env_vars"].update(loopback_interfaces())
        with loopback_node():
            start_local_ray(num_cpus=max(os.cpu_count() or 1, int(min_cpus + 0.999)), include_dashboard=False,
                            dashboard_host="127.0.0.1", _system_config={"worker_niceness": 0}, **options)
        if not is_loopback(ray.util.get_node_ip_address()):
            warnings.warn(f"the local Ray instance listens on {ray.util.get_node_ip_address()}, not on loopback "
                          f"only: this Ray ({ray.__version__}) did not take cluster/loopback.py's setting",
                          RuntimeWarning, stacklevel=3)
    try:
        yield
    finally:
        ray.shutdown()


AUTH_HINT = ("if the cluster uses token authentication (Ray 2.60's `ray start --head` turns it on), set "
             "RAY_AUTH_MODE=token and give this machine the cluster's token (~/.ray/auth_token, RAY_AUTH_TOKEN "
             "or RAY_AUTH_TOKEN_PATH); see README 'Running on a cluster'")


def _connect(address: str, options: dict) -> None:
    """``ray.init(address)``, sending the local token to a local cluster, and saying why a connection failed."""
    explicit = (os.environ.get("RAY_ADDRESS") or "") if address == "auto" else address
    if explicit and "RAY_AUTH_MODE" not in os.environ and _is_this_machine(explicit):
        _enable_token_auth_if_token_available()
    target = explicit or _address_ray_finds()
    # A GCS on loopback only admits nodes of this machine, on loopback too: every rank is here.
    joins_laptop_instance = bool(target) and _is_this_machine(target) and is_loopback_only(target)
    if joins_laptop_instance:
        options["runtime_env"]["env_vars"].update(loopback_interfaces())
    try:
        with loopback_node() if joins_laptop_instance else contextlib.nullcontext():
            ray.init(address=address, **options)
    except ConnectionError as error:
        raise ConnectionError(f"cannot connect to the Ray cluster at {explicit or address}: {error}; "
                              f"{AUTH_HINT}") from error
    if joins_laptop_instance and (elsewhere := nodes_off_loopback(ray.nodes())):
        warnings.warn(f"the Ray at {target} answers on loopback only, yet has nodes at {elsewhere}: the ranks' "
                      "gloo and NCCL listen on loopback, so ranks on those nodes cannot connect", RuntimeWarning,
                      stacklevel=4)


def _address_ray_finds() -> str | None:
    """The address ``ray.init("auto")`` connects to without RAY_ADDRESS (the newest ``ray start`` here)."""
    try:  # private: where it is gone, a laptop instance is joined by its explicit address only
        from ray._private.services import get_ray_address_from_environment
        return get_ray_address_from_environment("auto", None)
    except Exception:  # noqa: BLE001 - no cluster found: ray.init says so itself
        return None


def _is_this_machine(address: str) -> bool:
    """Whether ``host:port`` names an address of this machine (a socket can bind to it)."""
    if address.startswith("ray://"):
        return False
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    try:
        candidates = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    for ip in candidates:
        try:
            with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as probe:
                probe.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


def _enable_token_auth_if_token_available() -> None:
    try:  # Ray's own step for clusters it finds itself; private, so tolerate its absence
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)

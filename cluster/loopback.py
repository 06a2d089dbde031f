"""A local Ray instance, and the process groups of its runs, reachable from this machine only.

Ray 2.60 binds its services (GCS, raylet, object manager, workers, agents) to the node's IP, which for a
local instance is the machine's address on its network, unless Ray's cluster mode is off (as Ray has it
on macOS and Windows, against firewall prompts): then the node IP is 127.0.0.1 and every one of them
listens on loopback. ``loopback_node()`` turns cluster mode off while ``ray.init`` starts the node, and
only then. ``ray start`` takes the same setting from its environment: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
ray start --head`` starts a head whose every service listens on loopback (``--node-ip-address=127.0.0.1`` alone
does not: with cluster mode on, Ray replaces a loopback node address with the network one). gloo and NCCL bind to
the address the hostname resolves to unless told an interface: ``loopback_interfaces()`` names the loopback one to
both, for the job's runtime env.

Example::

    with loopback_node():
        ray.init(address="local", runtime_env={"env_vars": loopback_interfaces()})
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterator

import psutil


def loopback_interface() -> str:
    """The name of this machine's IPv4 loopback interface ("lo" on Linux, "lo0" on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and ipaddress.ip_address(a.address).is_loopback for a in addresses):
            return name
    raise RuntimeError("this machine has no IPv4 loopback interface (127.0.0.1): a local Ray cannot be kept on it")


def loopback_interfaces() -> dict[str, str]:
    """Environment variables that bind gloo's and NCCL's sockets to the loopback interface."""
    name = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """While this block starts a local Ray node, its IP is 127.0.0.1 (Ray's cluster mode off: a private
    constant of Ray's, read when the node starts)."""
    from ray._private import ray_constants

    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous


def network_address() -> str | None:
    """An IPv4 address of this machine on a network (not loopback), if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


def is_loopback_only(address: str) -> bool:
    """Whether the Ray whose GCS is at ``address`` ("host:port" on this machine) answers on 127.0.0.1 and not on
    the machine's network address: an instance started in laptop mode. A driver joining it must start under
    ``loopback_node()`` too, or Ray turns 127.0.0.1 into the network address, where nothing answers."""
    port = address.rpartition(":")[2]
    if not port.isdigit() or not _answers("127.0.0.1", int(port)):
        return False
    network = network_address()
    return network is None or not _answers(network, int(port))


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def nodes_off_loopback(nodes: list[dict]) -> list[str]:
    """The addresses of the live nodes among ``nodes`` (``ray.nodes()``) that are not on loopback."""
    return sorted({node["NodeManagerAddress"] for node in nodes
                   if node.get("Alive") and not is_loopback(node["NodeManagerAddress"])})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, IPv4-mapped IPv6 included) is a loopback address."""
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback

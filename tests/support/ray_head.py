"""A real ``ray start --head`` owned by one test module: started in the background, stopped by SIGTERM.

``ray start --head --block`` stops every process it started when it gets SIGTERM (~3 s), so a test
can own its head node without a broad ``ray stop`` that would end other people's Ray. Every port
is chosen free (two heads on one machine must not share the dashboard agent's or client
server's default ports), and the session lives in its own short temp dir, so ``/tmp/ray``'s
"current cluster" that others' ``--address auto`` reads is left alone; drivers here get the
address through ``RAY_ADDRESS``.

Token authentication is left to Ray, as for a user: ``ray start --head`` turns it on because a
token exists at ``~/.ray/auth_token`` (created by ``ray get-auth-token --generate`` or by any
local ``ray.init``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
STOP_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
"""Ray 2.60's raylet waits a fixed 15 s for its dashboard agent to write its ports, and aborts past it (raylet.err:
"Timed out waiting for file .../metrics_agent_port_..."): on a loaded 2-core machine the agent's imports took 22 s,
and ``ray start`` exited 1. A node whose start ends so is started again."""
PRESTART_OFF = {"RAY_prestart_worker_first_driver": "0"}
"""No idle Python workers started ahead of a first driver: fewer processes on a small, shared machine."""
START_TIMEOUT_S = 300.0
"""How long a node's start may take: beside a second test suite a head's dashboard took over Ray's 60 s."""
SLOW_DASHBOARD_OK = {"RAY_DASHBOARD_STARTUP_TIMEOUT_S": str(int(START_TIMEOUT_S))}
"""Ray waits 60 s for its dashboard to start, then gives up, and the head never comes up."""


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def auth_token() -> str:
    """The local token (``ray get-auth-token --generate`` makes one if missing, as a user would)."""
    path = Path.home() / ".ray" / "auth_token"
    if not path.is_file():
        subprocess.run([str(VENV_BIN / "ray"), "get-auth-token", "--generate"], check=True, capture_output=True)
    return path.read_text().strip()


@dataclass
class RayHead:
    """A head node's addresses and the environment a client on this machine uses with it."""

    process: subprocess.Popen
    temp_dir: str
    gcs_address: str
    dashboard_url: str
    metrics_port: int
    log_path: Path
    descendants: dict[int, str] = field(default_factory=dict)
    """Processes the head started: pid -> start time (so a reused pid is never signalled)."""

    def client_env(self, *, driver: bool = True, **extra: str) -> dict[str, str]:
        """This process's environment, the venv's bin first on PATH; for a driver, RAY_ADDRESS set to the head
        (the ``ray job`` CLI must not have it: it would take that GCS address for the job server's)."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
        env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", CI="true", **extra)
        if driver:
            env["RAY_ADDRESS"] = self.gcs_address
        return env

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_head(num_cpus: int = 2, *, extra_env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S,
               bin_dir: Path = VENV_BIN, without: tuple[str, ...] = ()) -> RayHead:
    """``ray start --head --block`` on free ports, 127.0.0.1 dashboard, with the ``python`` and ``ray`` of ``bin_dir``
    (first on its PATH: the jobs run that python) and none of the environment variables ``without``; returns once
    it is up."""
    auth_token()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", *without)}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"  # as with the venv activated: jobs run its python
    env.update(PRESTART_OFF, **SLOW_DASHBOARD_OK, **(extra_env or {}))
    for _ in range(START_ATTEMPTS):
        gcs, dashboard, metrics, client, agent = free_ports(5)
        temp_dir = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: Ray's socket paths have a length limit
        log_path = Path(temp_dir) / "head.log"
        command = [str(bin_dir / "ray"), "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--port={gcs}",
                   "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--metrics-export-port={metrics}",
                   f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
                   f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        head = RayHead(process=process, temp_dir=temp_dir, gcs_address="", metrics_port=metrics, log_path=log_path,
                       dashboard_url=f"http://127.0.0.1:{dashboard}")
        try:
            up = wait_until_up(process, lambda head=head: "Ray runtime started" in head.log(), timeout_s)
        except RuntimeError as error:
            log = head.log()
            stop_head(head)
            raise RuntimeError(f"{error}:\n{log[-3000:]}") from None
        if up:
            break
        log = head.log()
        stop_head(head)
    else:
        raise RuntimeError(f"ray start --head exited {START_ATTEMPTS} times before it was up:\n{log[-3000:]}")
    found = re.search(r"--address='([^']+)'", re.sub(r"\x1b\[[0-9;]*m", "", head.log()))
    head.gcs_address = found.group(1) if found else f"127.0.0.1:{gcs}"
    head.descendants = _descendants(process.pid)
    return head


def wait_until_up(process: subprocess.Popen, is_up: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``is_up()`` before the ``ray start`` ``process`` exited (False: it exited first, see START_ATTEMPTS);
    raises RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not is_up():
        if process.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"{' '.join(process.args[:3])} was not up within {timeout_s:.0f} s")
        time.sleep(0.5)
    return True


def python_without_raylastic(directory: Path) -> Path:
    """A virtual environment in ``directory`` with every package of this one but raylastic (its site-packages
    added as a plain path, so the editable install's finder, started by a .pth file there, is not); returns its
    bin directory, holding ``python`` and ``ray``. Run it without ``PYTHONPATH``, which may name a checkout."""
    venv.create(directory, with_pip=False)
    python = directory / "bin" / "python"
    target = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    Path(target, "this_venvs_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    ray = directory / "bin" / "ray"
    ray.write_text(f"#!{python}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    ray.chmod(0o755)
    return directory / "bin"


def stop_head(head: RayHead) -> None:
    """SIGTERM to the ``ray start --block`` process (it stops its children); SIGKILL what we started if stuck."""
    head.descendants.update(_descendants(head.process.pid))
    if head.process.poll() is None:
        head.process.send_signal(signal.SIGTERM)
        try:
            head.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            head.process.kill()
            head.process.wait()
    deadline = time.monotonic() + 10
    while (left := [p for p, started in head.descendants.items() if process_start_time(p) == started]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # still there after the head stopped: ours, so ours to end
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def listening_addresses(port: int) -> set[str]:
    """The local addresses on which a TCP socket listens on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # kernel byte order per word
                found.add(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, words))
    return found


def session_processes(session_suffix: str) -> dict[int, str]:
    """pid -> command line of the processes whose command line names a Ray session ending in ``session_suffix``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if re.search(rf"session_[\d_-]+{re.escape(session_suffix)}\b", command):
                found[int(entry.name)] = command
    return found


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below ``root`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid in [p for p, pp in parents.items() if pp == parent]:
            if (started := process_start_time(pid)) is not None:
                found[pid] = started
                frontier.append(pid)
    return found


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started (/proc/<pid>/stat's 22nd field): with the pid, it names one process; None if
    none runs."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None

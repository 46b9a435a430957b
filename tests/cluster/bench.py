"""Real hosts on one machine: Linux network namespaces on one bridge, links shaped with ``tc tbf``.

Each host is a network namespace with its own loopback (ranks on one host talk over it, fast) and an ``eth0``
whose veth peer sits on a bridge in the root namespace; the bridge carries the orchestrator's address. Both ends of
every veth are rate-limited with ``tbf`` (``netem`` is not available here, so there is no emulated delay), so
traffic between hosts crosses a slow link — a real two-level topology. Addresses come from 198.18.0.0/24, the
range reserved for benchmarks; nothing else is routed.

    python -m tests.cluster.bench up --hosts 3      # prints the hosts and their addresses, leaves them up
    python -m tests.cluster.bench down              # removes every namespace and link this bench created

In tests: ``with Bench(3) as bench: bench.popen(0, [...])``. Leaving the block — also through an exception —
kills every process left in the namespaces and removes them; :func:`remove_leftovers` clears what a killed test
session left behind. Creating namespaces needs root (``CAP_NET_ADMIN``); :func:`bench_unavailable` says why not.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

PREFIX = "kcb"  # every namespace and link of the bench starts with this
SUBNET = "198.18.0"
BRIDGE_ADDRESS = f"{SUBNET}.1"
RATE = "400mbit"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def bench_unavailable() -> str | None:
    """Why the bench cannot run here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is missing"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run the cluster tests as root"
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_leftovers() -> list[str]:
    """Remove every namespace and link whose name starts with the bench prefix; returns what was removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX):
                _ip("link", "del", name, check=False)
                removed.append(name)
    return removed


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


@dataclass
class Host:
    """One bench host: its namespace, its address on the bridge and its training interface."""

    index: int
    netns: str
    address: str
    ifname: str = "eth0"
    #: the root-namespace end of the host's veth, on the bridge
    outer: str = ""

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Bench:
    """``hosts`` namespaces on one bridge; a context manager that removes them again (see the module docstring)."""

    hosts_wanted: int = 2
    rate: str | None = RATE
    hosts: list[Host] = field(default_factory=list)
    bridge: str = f"{PREFIX}br0"
    address: str = BRIDGE_ADDRESS
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> Bench:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Create the bridge and the hosts (leftovers of an earlier bench are removed first)."""
        remove_leftovers()
        atexit.register(self.down)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.hosts_wanted):
                self.hosts.append(self._add_host(i))
        except BaseException:
            self.down()
            raise

    def _add_host(self, i: int) -> Host:
        ns, outer, inner = f"{PREFIX}h{i}", f"{PREFIX}v{i}", f"{PREFIX}p{i}"
        host = Host(i, ns, f"{SUBNET}.{10 + i}", outer=outer)
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "link", "set", inner, "name", host.ifname)
        _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
        _ip("-n", ns, "link", "set", host.ifname, "up")
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        if self.rate:
            shape = ["root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"]
            subprocess.run(["tc", "qdisc", "add", "dev", outer, *shape], check=True, capture_output=True)
            subprocess.run(host.command(["tc", "qdisc", "add", "dev", host.ifname, *shape]), check=True)
        return host

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (killed when the bench goes down)."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.hosts[host].command(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def kill_host(self, host: int) -> int:
        """SIGKILL every process inside host ``host`` (a node lost); returns how many were killed."""
        pids = _ip("netns", "pids", self.hosts[host].netns, check=False).stdout.split()
        _kill_namespace_processes(self.hosts[host].netns)
        return len(pids)

    def down(self) -> None:
        """Kill what runs in the hosts and remove namespaces, veths and the bridge (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for host in self.hosts:
            _kill_namespace_processes(host.netns)
        time.sleep(0.05)
        for host in self.hosts:
            # deleting one end of a veth removes both at once; a namespace's own links go in the kernel's deferred
            # namespace cleanup, which can leave the root end behind for a while after `ip netns del` returns
            if host.outer:
                _ip("link", "del", host.outer, check=False)
            _ip("netns", "del", host.netns, check=False)
        self.hosts.clear()
        _ip("link", "del", self.bridge, check=False)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the hosts and leave them up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default=RATE, help="tbf rate of every link, e.g. 400mbit; 'none' for unshaped")
    sub.add_parser("down", help="remove every namespace and link of the bench")
    args = ap.parse_args(argv)
    if args.cmd == "down":
        print("removed:", " ".join(remove_leftovers()) or "nothing")
        return 0
    why = bench_unavailable()
    if why:
        print(f"cannot build the bench: {why}", file=sys.stderr)
        return 2
    bench = Bench(args.hosts, None if args.rate == "none" else args.rate)
    bench.up()
    atexit.unregister(bench.down)
    print(f"bridge {bench.bridge} {bench.address}")
    for h in bench.hosts:
        print(f"host {h.index}: netns {h.netns} address {h.address} ifname {h.ifname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

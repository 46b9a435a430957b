"""Real hosts on one machine: Linux network namespaces on one bridge, links shaped with ``tc tbf``.

Each host is a network namespace with its own loopback (ranks on one host talk over it, fast) and an ``eth0``
whose veth peer sits on a bridge in the root namespace; the bridge carries the orchestrator's address. Both ends of
every veth are rate-limited with ``tbf`` (``netem`` is not available here, so there is no emulated delay), so
traffic between hosts crosses a slow link — a real two-level topology. Each bench claims its own name prefix and a
free /24 of 198.18.0.0/15, the range reserved for benchmarks (``tests/cluster/netlab.py``), so two benches — two
copies of the test suite, or the bench next to a Slurm lab — run side by side, and each removes only its own hosts.

    python -m tests.cluster.bench up --hosts 3      # prints the hosts and their addresses, leaves them up
    python -m tests.cluster.bench down              # removes the benches left up, and those of dead test runs

In tests: ``with Bench(3) as bench: bench.popen(0, [...])``. Leaving the block — also through an exception —
kills every process left in the namespaces and removes them; a bench whose test process was killed is removed by
the next bench or Slurm lab that comes up (:func:`remove_leftovers` does it by hand). Creating namespaces needs
root (``CAP_NET_ADMIN``); :func:`bench_unavailable` says why not.
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

from tests.cluster import netlab

KIND = "kb"  # every bench's prefix starts with this (then six random letters or digits)
RATE = "400mbit"


def bench_unavailable() -> str | None:
    """Why the bench cannot run here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is missing"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run the cluster tests as root"
    probe = f"{KIND}probe{os.getpid() % 100000}"
    made = netlab.ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    netlab.ip("netns", "del", probe, check=False)
    return None


def remove_leftovers(persistent: bool = False) -> list[str]:
    """Remove the benches whose test process is gone (with ``persistent``, also those ``up`` left up); returns the
    names removed. A running bench is never touched."""
    return netlab.reap(KIND, persistent=persistent)


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
    """``hosts`` namespaces on one bridge; a context manager that removes them again (see the module docstring).
    ``address`` (the bridge's, the orchestrator's) and the hosts' addresses are known once ``up`` has run."""

    hosts_wanted: int = 2
    rate: str | None = RATE
    hosts: list[Host] = field(default_factory=list)
    bridge: str = ""
    address: str = ""
    #: keep the hosts after this process ends (the ``up`` command); ``down`` removes them
    persistent: bool = False
    claim: netlab.Claim | None = None
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> Bench:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Claim a prefix and a free /24, create the bridge and the hosts."""
        self.claim = netlab.claim(KIND, owner=0 if self.persistent else None)
        atexit.register(self.down)
        try:
            self.address = netlab.add_bridge(self.claim)
            self.bridge = self.claim.bridge
            for i in range(self.hosts_wanted):
                self.hosts.append(self._add_host(i))
        except BaseException:
            self.down()
            raise

    def _add_host(self, i: int) -> Host:
        address = f"{self.claim.subnet}.{10 + i}"
        ns, outer = netlab.add_host(self.claim, i, address)
        host = Host(i, ns, address, outer=outer)
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
        self.claim.add_pid(proc.pid)
        return proc

    def free_port(self) -> int:
        """A TCP port free on the bridge address (for a server the hosts reach: never a fixed one)."""
        return netlab.free_port(self.address)

    def kill_host(self, host: int) -> int:
        """SIGKILL every process inside host ``host`` (a node lost); returns how many were killed."""
        return netlab.kill_namespace(self.hosts[host].netns)

    def leftovers(self) -> list[str]:
        """This bench's namespaces and links that still exist (none after ``down``)."""
        return netlab.existing(self.claim) if self.claim else []

    def down(self) -> None:
        """Kill what runs in the hosts and remove this bench's namespaces, veths and bridge (idempotent); never
        anything another bench or lab made."""
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
        if self.claim is not None:
            time.sleep(0.05)
            netlab.release(self.claim)
        self.hosts.clear()


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the hosts and leave them up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default=RATE, help="tbf rate of every link, e.g. 400mbit; 'none' for unshaped")
    sub.add_parser("down", help="remove the benches `up` left, and those of test runs that died")
    args = ap.parse_args(argv)
    if args.cmd == "down":
        print("removed:", " ".join(remove_leftovers(persistent=True)) or "nothing")
        return 0
    why = bench_unavailable()
    if why:
        print(f"cannot build the bench: {why}", file=sys.stderr)
        return 2
    bench = Bench(args.hosts, None if args.rate == "none" else args.rate, persistent=True)
    bench.up()
    atexit.unregister(bench.down)
    print(f"bridge {bench.bridge} {bench.address}")
    for h in bench.hosts:
        print(f"host {h.index}: netns {h.netns} address {h.address} ifname {h.ifname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

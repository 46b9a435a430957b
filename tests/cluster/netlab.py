"""Network labs that share one machine: each run claims its own names, subnet and ports, and removes only those.

A lab (the multi-host bench, a Slurm lab) is a bridge in the root namespace plus one network namespace per host.
Several labs may run at once — two copies of the test suite, the bench next to a Slurm cluster — so a run never
uses a fixed name, subnet or port, and never removes by name pattern:

- :func:`claim` picks, under one machine-wide lock, a random name prefix (``<kind><6 letters or digits>``; with a
  host index every interface name stays within Linux's 15 characters) and a /24 of the benchmark range
  198.18.0.0/15 that no interface or route uses and no other claim holds (never 198.18.0.0/24 nor 198.18.5.0/24,
  the defaults of older benches and of ``shared/tools/slurmlab``). The claim is a JSON record in ``/run/kc-netlab``
  naming its owner process, and the run adds to it every namespace, link and process it makes.
- :func:`release` undoes one claim: its recorded processes (TERM, then KILL), whatever still runs in its namespaces
  (``ip netns pids``), its links, its namespaces, its bridge, its record.
- :func:`reap` releases the claims whose owner process is gone (a test session killed with ``-9``); a running lab
  is never touched. Every :func:`claim` reaps first.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import string
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RUN_DIR = Path(os.environ.get("KC_NETLAB_DIR", "/run/kc-netlab"))
RANGE = ipaddress.ip_network("198.18.0.0/15")
RESERVED = ("198.18.0", "198.18.5")  # the older fixed bench subnet and slurmlab's default: never claimed
IFNAME_MAX = 15


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS`` (iproute2), output captured."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on right now, on ``host`` (every address by default)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_time(pid: int) -> int | None:
    """The kernel's start time of process ``pid`` (clock ticks since boot), or None when there is no such process;
    a pid with the recorded start time is the same process, not a reused number."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, started: int | None) -> bool:
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def running(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` started at ``started`` still runs (a zombie does not)."""
    return _alive(pid, started) and not _zombie(pid)


@dataclass
class Claim:
    """What one lab run owns: its name prefix, its /24 (``subnet`` is the first three octets) and what it made."""

    kind: str
    prefix: str
    subnet: str
    owner: int | None  # the process whose death makes the claim stale; None: kept until released by hand
    owner_start: int | None = None
    bridge: str = ""
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    pids: list[list[int | None]] = field(default_factory=list)  # [pid, start time]
    directory: str = ""  # a directory made for the lab alone: removed with it

    @property
    def path(self) -> Path:
        return RUN_DIR / f"{self.prefix}.json"

    def save(self) -> None:
        """Write the record (atomically: a reaper reads either the old or the new one)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(self.path)

    def add_pid(self, pid: int) -> None:
        """Record a process this run started (killed by :func:`release`, also by another run's :func:`reap`)."""
        self.pids.append([pid, start_time(pid)])
        self.save()

    def name(self, suffix: str) -> str:
        """``prefix + suffix``, refused when longer than an interface name may be."""
        name = self.prefix + suffix
        if len(name) > IFNAME_MAX:
            raise ValueError(f"interface name {name!r} is longer than {IFNAME_MAX} characters")
        return name

    def stale(self) -> bool:
        return self.owner is not None and not _alive(self.owner, self.owner_start)


@contextlib.contextmanager
def _locked():
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(RUN_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def claims() -> list[Claim]:
    """Every recorded claim on this machine."""
    found = []
    for path in sorted(RUN_DIR.glob("*.json")) if RUN_DIR.is_dir() else []:
        try:
            found.append(Claim(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return found


def _used_subnets() -> set[str]:
    used = set(RESERVED) | {c.subnet for c in claims()}
    for args in (("-o", "-4", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for word in ip(*args, check=False).stdout.split():
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_interface(word).network if "/" in word else ipaddress.ip_network(f"{word}/32")
                if net.overlaps(RANGE):
                    for sub in net.subnets(new_prefix=24) if net.prefixlen < 24 else [net.supernet(new_prefix=24)]:
                        used.add(str(sub.network_address).rsplit(".", 1)[0])
    return used


def claim(kind: str, owner: int | None = None) -> Claim:
    """Claim a fresh prefix and /24 for a lab of ``kind`` (two lowercase letters, e.g. ``kb``), owned by process
    ``owner`` (this one by default; pass ``owner=0`` for a claim that outlives its process)."""
    if len(kind) != 2:
        raise ValueError(f"a lab kind is two letters, not {kind!r}")
    owner = os.getpid() if owner is None else (owner or None)
    with _locked():
        _reap()
        taken = {c.prefix for c in claims()}
        alphabet = string.ascii_lowercase + string.digits
        prefix = next(p for p in (kind + "".join(random.choices(alphabet, k=6)) for _ in range(100)) if p not in taken)
        used = _used_subnets()
        free = [s for s in (f"198.{18 + i // 256}.{i % 256}" for i in range(512)) if s not in used]
        if not free:
            raise RuntimeError("no free /24 left in 198.18.0.0/15 for a network lab")
        c = Claim(kind, prefix, random.choice(free), owner, start_time(owner) if owner else None)
        c.save()
        return c


def _kill(pids: list[tuple[int, int | None]], grace_s: float) -> None:
    live = [(p, s) for p, s in pids if _alive(p, s)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            live = [(p, s) for p, s in live if _alive(p, s) and not _zombie(p)]
        if not live:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def kill_namespace(netns: str) -> int:
    """SIGKILL every process in network namespace ``netns``; returns how many there were."""
    pids = ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)
    return len(pids)


def existing(c: Claim) -> list[str]:
    """The namespaces, links and bridge of claim ``c`` that still exist."""
    names = set(ip("netns", "list", check=False).stdout.split())
    links = {
        line.split(":")[1].strip().split("@")[0]
        for line in ip("-o", "link", "show", check=False).stdout.splitlines()
        if line.count(":") > 1
    }
    return [n for n in c.netns if n in names] + [n for n in [*c.links, c.bridge] if n and n in links]


def release(c: Claim, grace_s: float = 2.0) -> list[str]:
    """Remove everything claim ``c`` made (see the module docstring); returns the names removed. Idempotent."""
    _kill([(p, s) for p, s in c.pids], grace_s)
    for ns in c.netns:
        kill_namespace(ns)
    there = existing(c)
    for link in c.links:  # the root end of a veth first: namespace cleanup is deferred and can leave it behind
        if link in there:
            ip("link", "del", link, check=False)
    for ns in c.netns:
        if ns in there:
            ip("netns", "del", ns, check=False)
    if c.bridge in there:
        ip("link", "del", c.bridge, check=False)
    if c.directory:
        shutil.rmtree(c.directory, ignore_errors=True)
    c.path.unlink(missing_ok=True)
    return there


def reap(kind: str | None = None, persistent: bool = False) -> list[str]:
    """Release the claims (of ``kind``, or any) whose owner process is gone, and with ``persistent`` also those
    made to outlive their process; returns the names removed. Never touches a claim whose owner runs. Holds the
    machine's lab lock, so two reapers never release one claim at once."""
    with _locked():
        return _reap(kind, persistent)


def _reap(kind: str | None = None, persistent: bool = False) -> list[str]:
    removed = []
    for c in claims():
        if (kind is None or c.kind == kind) and (c.stale() or (persistent and c.owner is None)):
            removed += release(c, grace_s=0.5)
    return removed


def add_bridge(c: Claim) -> str:
    """Create the claim's bridge holding ``<subnet>.1``; returns that address."""
    c.bridge = c.name("br")
    c.save()
    address = f"{c.subnet}.1"
    ip("link", "add", c.bridge, "type", "bridge")
    ip("addr", "add", f"{address}/24", "dev", c.bridge)
    ip("link", "set", c.bridge, "up")
    return address


def add_host(c: Claim, index: int, address: str, ifname: str = "eth0") -> tuple[str, str]:
    """Create namespace ``<prefix>h<index>`` with ``ifname`` at ``address``/24, its veth peer on the claim's
    bridge; returns (namespace, root-side veth)."""
    ns, outer, inner = c.name(f"h{index}"), c.name(f"v{index}"), c.name(f"p{index}")
    c.netns.append(ns)
    c.links.append(outer)
    c.save()
    ip("netns", "add", ns)
    ip("-n", ns, "link", "set", "lo", "up")
    ip("link", "add", outer, "type", "veth", "peer", "name", inner)
    ip("link", "set", inner, "netns", ns)
    ip("-n", ns, "link", "set", inner, "name", ifname)
    ip("-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
    ip("-n", ns, "link", "set", ifname, "up")
    ip("link", "set", outer, "master", c.bridge)
    ip("link", "set", outer, "up")
    return ns, outer

"""A real Slurm cluster on one machine: slurmctld on a bridge, one slurmd per network namespace, munge, slurmdbd.

Each node is a network namespace (``tests/cluster/netlab.py``: this lab's own name prefix, /24 of 198.18.0.0/15
and record) entered with ``nsenter --net`` — not ``ip netns exec``, which remounts ``/sys`` so that slurmd 22.05
finds no cgroup file system and aborts — plus its own UTS namespace (its host name is its node name) and mount
namespace, where the lab's ``hosts`` file is bind-mounted over ``/etc/hosts`` so that every node name resolves
(torchrun's c10d rendezvous and Gloo resolve the host name). The controller, munged (a private key and socket),
slurmdbd and its MariaDB (``tests/cluster/slurm_db.py``) run in the root namespace, each on a free port. Nodes
share this machine's file system, so a job runs the project's Python. ``/etc/hosts``, ``/etc/slurm`` and
``/etc/munge`` are never touched; clients need the lab's ``env`` (``SLURM_CONF``).

    lab = SlurmLab(3)
    lab.up()              # about 3 s (munged, MariaDB, slurmdbd, slurmctld, every slurmd; all nodes idle)
    lab.run(["srun", "-N3", "hostname"]).stdout
    lab.down()            # by recorded PID, then what is left in its namespaces, then the namespaces

``down`` also runs at exit, and a lab whose process died is removed by the next lab or bench that comes up.
Needs root and Debian's ``slurm-wlm``, ``munge``, ``slurmdbd`` and ``mariadb-server-core`` (``.ci/run`` installs
them); :func:`slurm_unavailable` says what is missing.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.cluster import netlab, slurm_db

KIND = "ks"
COMMANDS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sacct", "scontrol", "nsenter", "unshare", "ip")
PACKAGES = "slurm-wlm munge slurmdbd mariadb-server-core"
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # the daemons live in sbin


def slurm_unavailable() -> str | None:
    """Why a Slurm lab cannot come up here (None when it can)."""
    if os.geteuid() != 0:
        return "a Slurm lab needs root (network namespaces, munged, slurmd)"
    missing = [c for c in (*COMMANDS, *slurm_db.COMMANDS) if shutil.which(c, path=PATH) is None]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install -y --no-install-recommends {PACKAGES}"
    return None


class SlurmLab:
    """``nodes`` Slurm nodes ``n1..nN`` (``cpus`` CPUs each) in partition ``debug``, with job accounting.
    ``slurmd_timeout`` is ``SlurmdTimeout``: with 10 s a killed node's job ends ``NODE_FAIL`` about 28 s after the
    kill (about 47 s with Slurm's default of 30 s; measured here).

    ``topology`` is an optional tree topology (``TopologyPlugin=topology/tree`` and ``topology.conf`` beside
    ``slurm.conf``, as Slurm 22.05 reads them): leaf switch name -> its nodes, with one spine ``s0`` over every
    leaf; :func:`default_topology` puts the nodes two by two under leaves ``s1``, ``s2`` … (3 nodes: ``s1: n1, n2``,
    ``s2: n3``). None (the default) leaves the plugin out (Slurm's ``topology/none``): with a tree, Slurm places a
    1-node job on the leaf with the fewest free nodes (``n3``), not on ``n1``.

    Once up: ``conf`` (slurm.conf), ``env`` (this process's environment without ``SLURM_*``/``SBATCH_*``/
    ``SALLOC_*``/``SRUN_*``, plus ``SLURM_CONF`` and sbin on ``PATH``: what a client needs), ``nodes``,
    ``node_addr`` (node -> address), ``partition``, ``directory``, ``address`` (the controller's, on the bridge),
    ``ports`` (slurmctld, slurmd, slurmdbd, mariadb) and ``claim`` (the lab's names and subnet, ``netlab.Claim``).
    """

    partition = "debug"

    def __init__(
        self,
        nodes: int = 3,
        directory: Path | None = None,
        cpus: int = 2,
        slurmd_timeout: int = 10,
        topology: dict[str, list[str]] | None = None,
    ):
        self.count, self.cpus, self.slurmd_timeout = nodes, cpus, slurmd_timeout
        self.nodes: list[str] = [f"n{i}" for i in range(1, nodes + 1)]
        self.topology: dict[str, list[str]] = topology or {}
        self.node_addr: dict[str, str] = {}
        self.claim: netlab.Claim | None = None
        self._given_directory = directory
        self.directory: Path = Path(directory) if directory else Path()
        self.conf: Path = Path()
        self.env: dict[str, str] = {}
        self.address = ""  # the controller's, on the bridge
        self._procs: dict[str, subprocess.Popen] = {}
        self._netns: dict[str, str] = {}
        self._veth: dict[str, str] = {}  # node -> the root end of its veth (on the lab's bridge)

    # -- life --------------------------------------------------------------------------------------------------

    def up(self, timeout_s: float = 60) -> SlurmLab:
        """Bring the cluster up: every node idle, accounting answering. On failure everything made is removed."""
        why = slurm_unavailable()
        if why:
            raise RuntimeError(f"cannot bring up a Slurm lab: {why}")
        self.claim = netlab.claim(KIND)
        atexit.register(self.down)
        try:
            self._make_directory()
            self.address = netlab.add_bridge(self.claim)
            for i, node in enumerate(self.nodes, 1):
                self.node_addr[node] = f"{self.claim.subnet}.{10 + i}"
                self._netns[node], self._veth[node] = netlab.add_host(self.claim, i, self.node_addr[node])
            self._write_configs()
            self._start_daemons(time.monotonic() + timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every process of the lab and remove its namespaces, links and bridge (idempotent). The lab
        directory goes too, except ``log/`` when the caller chose the directory."""
        if self.claim is None:
            return
        netlab.release(self.claim, grace_s=3.0)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._given_directory is None:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            for sub in ("state", "spool", "munge", "db", "run"):
                shutil.rmtree(self.directory / sub, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """This lab's namespaces and links, and its processes, still there (none after ``down``)."""
        if self.claim is None:
            return []
        alive = [f"pid {p}" for p, start in self.claim.pids if netlab.running(p, start)]
        return netlab.existing(self.claim) + alive

    # -- clients and nodes -------------------------------------------------------------------------------------

    def run(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        """Run Slurm client command ``args`` with the lab's environment (from the lab directory, output captured
        as text, 120 s limit: each can be overridden by keyword)."""
        kw.setdefault("env", self.env)
        kw.setdefault("cwd", self.directory)
        kw.setdefault("timeout", 120)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(args, **kw)

    def in_node(self, node: str, args: list[str]) -> list[str]:
        """The command line that runs ``args`` inside node ``node``: its network namespace, its host name, its
        ``/etc/hosts`` (fresh UTS and mount namespaces with the node's, so it works also when the node is dead)."""
        script = f'mount --bind {self.directory / "hosts"} /etc/hosts && hostname {node} && exec "$@"'
        netns = f"/run/netns/{self._netns[node]}"
        return ["nsenter", f"--net={netns}", "unshare", "--uts", "--mount", "sh", "-c", script, node, *args]

    def kill_node(self, node: str) -> int:
        """Kill node ``node``: its slurmd and every process in its network namespace (job steps, ranks), with
        SIGKILL — a node lost, as Slurm sees it. Returns how many processes were killed."""
        killed = 0
        proc = self._procs.get(f"slurmd-{node}")
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
            killed = 1
        return killed + netlab.kill_namespace(self._netns[node])

    def start_node(self, node: str) -> None:
        """(Re)start node ``node``'s slurmd (a killed node coming back: ``ReturnToService=2`` returns it to
        service once it registers)."""
        argv = ["slurmd", "-D", "-N", node, "-f", str(self.conf)]
        self._start(f"slurmd-{node}", self.in_node(node, argv))

    def shape_node(self, node: str, rate: str | None) -> None:
        """Limit every link of ``node`` to ``rate`` (``tc tbf`` on both ends of its veth, as the bench shapes hosts:
        DESIGN.md §5), or lift the limit (``None``). The qdiscs go with the veth when the lab goes down."""
        for dev, prefix in ((self._veth[node], []), ("eth0", ["-n", self._netns[node]])):
            subprocess.run(["tc", *prefix, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate:
                shape = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
                subprocess.run(["tc", *prefix, "qdisc", "add", "dev", dev, *shape], check=True, capture_output=True)

    def node_state(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` says it (``idle``, ``alloc``, ``down*`` ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    # -- inside up ---------------------------------------------------------------------------------------------

    def _make_directory(self) -> None:
        if self._given_directory is None:
            self.directory = Path(f"/tmp/kc-slurm-{self.claim.prefix}")
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o755)  # munged runs as munge: it must reach its socket directory
        for sub in ("state", "log", "munge", "db", "run", *(f"spool/{n}" for n in self.nodes)):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        if self._given_directory is None:  # made for the lab: removed with it, also by another run's reap
            self.claim.directory = str(self.directory)
            self.claim.save()
        socket_path = self.directory / "munge" / "munge.socket"
        if len(str(socket_path)) > 100:
            raise RuntimeError(f"lab directory too deep for a Unix socket path: {socket_path}")

    def _write_configs(self) -> None:
        d = self.directory
        self.ports = {
            "slurmctld": netlab.free_port(),
            "slurmd": netlab.free_port(),
            "slurmdbd": netlab.free_port(),
            "mariadb": netlab.free_port("127.0.0.1"),
        }
        me = socket.gethostname().split(".")[0]
        hosts = Path("/etc/hosts").read_text()
        hosts += f"\n{self.address} {me}-lab\n" + "".join(f"{a} {n}\n" for n, a in self.node_addr.items())
        (d / "hosts").write_text(hosts)
        self.conf = d / "slurm.conf"
        munge_socket = d / "munge" / "munge.socket"
        lines = [
            f"ClusterName={self.claim.prefix}",
            f"SlurmctldHost={me}({self.address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            f"SlurmctldPort={self.ports['slurmctld']}",
            f"SlurmdPort={self.ports['slurmd']}",
            # no cgroups: a namespace does not carry /sys/fs/cgroup usefully, and a test needs no enforcement
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            *slurm_db.slurm_conf_lines(self.address, self.ports["slurmdbd"], munge_socket),
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",  # a node whose slurmd comes back returns to service by itself
            "SlurmdParameters=config_overrides",  # the node lines declare other than the hardware: do not drain
            f"SlurmdTimeout={self.slurmd_timeout}",  # how soon a silent node is DOWN (its jobs NODE_FAIL)
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        if self.topology:
            lines.append("TopologyPlugin=topology/tree")
            leaves = [f"SwitchName={sw} Nodes={','.join(ns)}" for sw, ns in self.topology.items()]
            spine = f"SwitchName=s0 Switches={','.join(self.topology)}"
            (d / "topology.conf").write_text("\n".join([*leaves, spine]) + "\n")
        lines += [
            f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for n, a in self.node_addr.items()
        ]
        lines.append(
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        slurm_db.write_slurmdbd_conf(
            self.conf,
            munge_socket=munge_socket,
            dbd_port=self.ports["slurmdbd"],
            db_port=self.ports["mariadb"],
            run=d / "run",
        )
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        self.env.update(SLURM_CONF=str(self.conf), PATH=PATH)

    def _start_daemons(self, deadline: float) -> None:
        d = self.directory
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(d / "munge", "munge", "munge")
        shutil.chown(key, "munge", "munge")
        os.chmod(key, 0o400)
        munged = ["munged", "-F", f"--key-file={key}", f"--socket={d / 'munge' / 'munge.socket'}"]
        munged += [f"--pid-file={d / 'munge' / 'munged.pid'}", f"--log-file={d / 'log' / 'munged.log'}"]
        munged += [f"--seed-file={d / 'munge' / 'munged.seed'}"]
        self._start("munged", munged, user="munge", group="munge", extra_groups=[])
        (d / "db" / "data").mkdir(exist_ok=True)
        self._start("mariadbd", slurm_db.mariadbd_argv(d / "db", self.ports["mariadb"]))
        self._wait(lambda: _accepts(str(d / "munge" / "munge.socket")), deadline, "munged", "munged")
        self._wait(lambda: _accepts(("127.0.0.1", self.ports["mariadb"])), deadline, "MariaDB", "mariadbd")
        self._start("slurmdbd", ["slurmdbd", "-D"])
        self._wait(lambda: _accepts(("127.0.0.1", self.ports["slurmdbd"])), deadline, "slurmdbd", "slurmdbd")
        self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait(lambda: _accepts((self.address, self.ports["slurmctld"])), deadline, "slurmctld", "slurmctld")
        for node in self.nodes:
            self.start_node(node)
        self._wait(
            lambda: sorted(s for s in self.node_state().values()) == ["idle"] * self.count,
            deadline,
            f"all {self.count} nodes idle",
            "slurmctld",
        )

    def _start(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        with open(self.directory / "log" / f"{name}.out", "ab") as log:
            proc = subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, **kw,
            )  # fmt: skip
        self._procs[name] = proc
        self.claim.add_pid(proc.pid)
        return proc

    def _wait(self, ready, deadline: float, what: str, daemon: str) -> None:
        dead: list[str] = []
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [n for n, p in self._procs.items() if p.poll() is not None and not n.startswith("slurmd-")]
            if dead:
                break
            time.sleep(0.1)
        logs = sorted((self.directory / "log").glob(f"{daemon}*"))
        tail = "\n".join(f"--- {p.name}:\n" + p.read_text(errors="replace")[-1500:] for p in logs)
        raise RuntimeError(f"Slurm lab: {what} not ready (exited: {dead or 'none'}); logs:\n{tail}")


def default_topology(nodes: list[str]) -> dict[str, list[str]]:
    """Leaf switches ``s1``, ``s2`` … of two nodes each, in order (3 nodes: ``s1: n1, n2``, ``s2: n3``)."""
    return {f"s{i // 2 + 1}": nodes[i : i + 2] for i in range(0, len(nodes), 2)}


def _accepts(address) -> bool:
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        try:
            s.connect(address)
            return True
        except OSError:
            return False

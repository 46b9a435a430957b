"""What Slurm knows about its nodes (issue 32 §5): one :class:`NodeFacts` per node from ``scontrol show node -o``
(address, CPUs, GPUs from ``Gres``, memory, state, features, partitions) and, on a cluster with Slurm's tree
topology (``TopologyPlugin=topology/tree``, ``topology.conf``), each node's leaf switch from ``scontrol show
topology``.

The orchestrator writes the facts of an attempt's nodes to ``attempt_<n>/slurm/nodes.json`` and says one line per
node (:func:`record_attempt_nodes`); ``kc doctor`` summarizes a partition's idle nodes and whether enough of them sit
under the leaf switches a job asks for (``cluster.slurm.switches``; :func:`switch_fit`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kuangchao_core.sched.slurm import commands
from kuangchao_core.sched.slurm.commands import SlurmRefused, parse_record

#: state flags (after ``+``) that keep Slurm from starting a new job on a node
UNAVAILABLE_FLAGS = {
    "DRAIN",
    "DRAINING",
    "DRAINED",
    "FAIL",
    "MAINTENANCE",
    "NOT_RESPONDING",
    "POWERED_DOWN",
    "POWERING_DOWN",
    "POWERING_UP",
    "REBOOT_REQUESTED",
    "REBOOT_ISSUED",
    "RESERVED",
}
_NULL = {"", "(null)", "N/A", "None"}
_BRACKET = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True)
class NodeFacts:
    """One node as Slurm describes it. ``state`` is Slurm's, flags included (``IDLE``, ``MIXED``, ``ALLOCATED``,
    ``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING`` …); ``memory_mb`` is ``RealMemory``; ``switch`` the leaf switch
    (None without a tree topology)."""

    name: str
    addr: str
    cpus: int
    cpus_alloc: int = 0
    gpus: int = 0
    gpus_alloc: int = 0
    gpu_types: tuple[str, ...] = ()
    memory_mb: int = 0
    state: str = "UNKNOWN"
    features: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    switch: str | None = None
    reason: str | None = None

    @property
    def base_state(self) -> str:
        """The state without flags and without the ``*`` (not responding) mark: ``IDLE+DRAIN`` → ``IDLE``."""
        return self.state.split("+", 1)[0].rstrip("*~#!%$@^-")

    @property
    def flags(self) -> set[str]:
        """The state's flags: ``IDLE+DRAIN`` → ``{"DRAIN"}`` (a trailing ``*`` counts as ``NOT_RESPONDING``)."""
        out = set(self.state.split("+")[1:])
        return out | {"NOT_RESPONDING"} if self.state.split("+", 1)[0].endswith("*") else out

    @property
    def idle(self) -> bool:
        """Slurm could start a job on the whole node now: ``IDLE`` with no flag that keeps jobs off it."""
        return self.base_state == "IDLE" and not (self.flags & UNAVAILABLE_FLAGS)

    def to_dict(self) -> dict:
        """JSON-ready form (with ``idle``)."""
        out = asdict(self)
        out.update(gpu_types=list(self.gpu_types), features=list(self.features), partitions=list(self.partitions))
        return {**out, "idle": self.idle}

    def line(self) -> str:
        """One line for a log: ``n1 (198.18.0.11): IDLE, 2 CPUs, 0 GPUs, 1000 MB, switch s1``."""
        gpus = f"{self.gpus} GPUs" + (f" ({','.join(self.gpu_types)})" if self.gpu_types else "")
        text = f"{self.name} ({self.addr}): {self.state}, {self.cpus} CPUs, {gpus}, {self.memory_mb} MB"
        text += f", features {','.join(self.features)}" if self.features else ""
        return text + (f", switch {self.switch}" if self.switch else "")


def _int(text: str | None) -> int:
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return 0


def _names(text: str | None) -> tuple[str, ...]:
    if text is None or text.strip() in _NULL:
        return ()
    return tuple(word for word in text.strip().split(",") if word)


def parse_gres(gres: str | None) -> tuple[int, tuple[str, ...]]:
    """``(GPU count, GPU types)`` of a node's ``Gres``: ``gpu:8``, ``gpu:h100:8(S:0-1)``,
    ``gpu:a100:4,gpu:v100:2,nic:1``, ``gpu:h100:8(IDX:0-7)`` (other resources are left out)."""
    if gres is None or gres.strip() in _NULL:
        return 0, ()
    count, types = 0, []
    for item in re.split(r",(?![^()]*\))", gres.strip()):  # commas inside "(S:0,1)" stay
        parts = item.split("(", 1)[0].split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) >= 3 or (len(parts) == 2 and not parts[1].isdigit()):
            types.append(parts[1])
        count += int(parts[-1]) if parts[-1].isdigit() and len(parts) > 1 else 1
    return count, tuple(dict.fromkeys(types))


def _tres(tres: str | None, key: str) -> int:
    """``gres/gpu=2`` of an ``AllocTRES`` (``cpu=2,mem=1000M,gres/gpu=2``): 2."""
    for item in _names(tres):
        name, _, value = item.partition("=")
        if name == key:
            return _int(value)
    return 0


def parse_node(line: str, switch: str | None = None) -> NodeFacts:
    """One ``scontrol show node -o`` line as :class:`NodeFacts`."""
    rec = parse_record(line)
    if "NodeName" not in rec:
        raise SlurmRefused(f"not a node record of `scontrol show node -o`: {line[:200]!r}")
    gpus, types = parse_gres(rec.get("Gres"))
    features = rec.get("ActiveFeatures") or rec.get("AvailableFeatures") or rec.get("Features")
    reason = rec.get("Reason", "").strip()
    return NodeFacts(
        name=rec["NodeName"],
        addr=rec.get("NodeAddr") or rec["NodeName"],
        cpus=_int(rec.get("CPUTot") or rec.get("CPUs")),
        cpus_alloc=_int(rec.get("CPUAlloc")),
        gpus=gpus,
        gpus_alloc=_tres(rec.get("AllocTRES"), "gres/gpu"),
        gpu_types=types,
        memory_mb=_int(rec.get("RealMemory")),
        state=(rec.get("State") or "UNKNOWN").strip(),
        features=_names(features),
        partitions=_names(rec.get("Partitions")),
        switch=switch,
        reason=reason or None,
    )


def expand_hostlist(expr: str) -> list[str]:
    """Slurm's host list expression as names: ``n[1-3,7],gpu[01-02]-a`` → ``n1 n2 n3 n7 gpu01-a gpu02-a``
    (zero padding kept; several bracket groups in one name multiply)."""
    out: list[str] = []
    for item in re.split(r",(?![^\[]*\])", expr.strip()):
        if not item:
            continue
        pieces = _BRACKET.split(item)  # text, range, text, range, ..., text
        choices: list[list[str]] = []
        for i, piece in enumerate(pieces):
            choices.append([piece] if i % 2 == 0 else _ranges(piece))
        out.extend("".join(parts) for parts in itertools.product(*choices))
    return out


def _ranges(spec: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


@dataclass
class Topology:
    """Slurm's tree topology: ``leaves`` (leaf switch → its nodes, in Slurm's order) and ``parents`` (switch → the
    switch above it). Empty without a tree topology."""

    leaves: dict[str, list[str]] = field(default_factory=dict)
    parents: dict[str, str] = field(default_factory=dict)

    def switch_of(self, node: str) -> str | None:
        """``node``'s leaf switch (None when no leaf lists it)."""
        return next((sw for sw, nodes in self.leaves.items() if node in nodes), None)


def parse_topology(text: str) -> Topology:
    """``scontrol show topology`` (one ``SwitchName=… Level=… Nodes=… Switches=…`` line per switch) as a
    :class:`Topology`; leaves are the switches of ``Level=0``."""
    topo = Topology()
    for line in text.splitlines():
        rec = parse_record(line)
        if "SwitchName" not in rec:
            continue
        name = rec["SwitchName"]
        if _int(rec.get("Level")) == 0 and rec.get("Nodes", "").strip() not in _NULL:
            topo.leaves[name] = expand_hostlist(rec["Nodes"])
        for child in expand_hostlist(rec.get("Switches", "")) if rec.get("Switches", "").strip() not in _NULL else []:
            topo.parents[child] = name
    return topo


def read_topology(env: dict[str, str]) -> Topology:
    """The cluster's tree topology (empty when Slurm has none: ``topology/none`` answers no switch)."""
    try:
        return parse_topology(commands.run(["scontrol", "show", "topology"], env, timeout_s=30))
    except SlurmRefused:
        return Topology()


def read_nodes(
    env: dict[str, str], nodes: list[str] | None = None, partition: str | None = None, topology: Topology | None = None
) -> list[NodeFacts]:
    """The facts of ``nodes`` (default: every node; with ``partition``, only that partition's), each with its leaf
    switch (``topology``, read when not given)."""
    argv = ["scontrol", "show", "node", "-o", *([",".join(nodes)] if nodes else [])]
    topo = read_topology(env) if topology is None else topology
    out = []
    for line in commands.run(argv, env, timeout_s=30).splitlines():
        if line.strip() and line.lstrip().startswith("NodeName="):
            facts = parse_node(line)
            out.append(replace(facts, switch=topo.switch_of(facts.name)))
    if partition is not None:
        out = [f for f in out if partition in f.partitions]
    return out


def summary(facts: list[NodeFacts]) -> str:
    """``2 of 3 nodes idle: 2 with 2 CPUs, 0 GPUs`` (idle nodes grouped by their CPUs and GPUs); the other
    nodes' states counted after it."""
    idle = [f for f in facts if f.idle]
    groups: dict[tuple[int, int], int] = {}
    for f in idle:
        groups[(f.cpus, f.gpus)] = groups.get((f.cpus, f.gpus), 0) + 1
    text = f"{len(idle)} of {len(facts)} nodes idle"
    if groups:
        text += ": " + ", ".join(f"{n} with {c} CPUs, {g} GPUs" for (c, g), n in sorted(groups.items()))
    busy: dict[str, int] = {}
    for f in facts:
        if not f.idle:
            busy[f.state] = busy.get(f.state, 0) + 1
    return text + ("" if not busy else "; " + ", ".join(f"{n} {s}" for s, n in sorted(busy.items())))


def idle_by_switch(facts: list[NodeFacts]) -> dict[str, list[str]]:
    """Each leaf switch's idle nodes, most first (nodes without a switch are left out)."""
    out: dict[str, list[str]] = {}
    for f in facts:
        if f.idle and f.switch:
            out.setdefault(f.switch, []).append(f.name)
    return dict(sorted(out.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def switch_fit(facts: list[NodeFacts], nodes: int, switches: int) -> tuple[bool, list[str]]:
    """Whether ``nodes`` idle nodes sit under at most ``switches`` leaf switches now, and the switches that hold the
    most idle nodes (``switches`` of them)."""
    best = list(idle_by_switch(facts).items())[:switches]
    return sum(len(n) for _, n in best) >= nodes, [sw for sw, _ in best]


def record_attempt_nodes(
    out: Path, nodes: list[str], env: dict[str, str], say: Callable[[str], None]
) -> list[NodeFacts]:
    """Write the facts of an attempt's ``nodes`` (in rendezvous order) to ``out/nodes.json`` and say one line
    per node; a Slurm command that fails is said, not raised (the facts are a record, the job runs without them)."""
    try:
        found = {f.name: f for f in read_nodes(env, nodes)}
    except SlurmRefused as exc:
        say(f"Slurm node facts unavailable: {exc}")
        return []
    facts = [found[n] for n in nodes if n in found]
    switches = sorted({f.switch for f in facts if f.switch})
    doc = {"nodes": [f.to_dict() for f in facts], "switches": switches}
    tmp = out / ".nodes.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    tmp.replace(out / "nodes.json")
    for f in facts:
        say(f"Slurm node {f.line()}")
    if switches:
        say(f"Slurm nodes under {len(switches)} leaf switch(es): {', '.join(switches)}")
    return facts

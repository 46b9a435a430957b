"""Topology probe (SPEC L4.2): latency and bandwidth between ranks and nodes, measured with real collectives.

``measure_rank`` runs inside an initialised default process group (Gloo or NCCL; under torchrun on a real
cluster, or in the processes :func:`kuangchao_core.sched.local_probe.probe_topology` spawns) and times:

- a small ``all_reduce`` (latency of a collective) and a large one (algorithm and bus bandwidth,
  ``busbw = algbw x 2(n-1)/n`` as nccl-tests define it);
- for every rank pair ``(i, j)``: a small ping-pong (one-way latency = round trip / 2) and a large one
  (point-to-point bandwidth = bytes / one-way time).

The pair matrices are then folded into a node matrix by the node of each rank: the best (lowest) latency and
best bandwidth seen between two nodes; the diagonal holds intra-node figures. The probe runs before capability
tokens exist, so it talks to ``torch.distributed`` directly, not through the guarded primitives.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.config.paths import machine_cache_dir
from kuangchao_core.errors import CommError

DEFAULT_SIZES = (8, 1 << 20)


@dataclass
class TopologyReport:
    """Measured latency and bandwidth; matrices are indexed by rank (``p2p_*``) or node (``node_*``)."""

    world_size: int
    node_of_rank: list[str]
    backend: str
    sizes: tuple[int, int]
    iters: int
    allreduce_latency_us: float
    allreduce_algbw_gbps: float
    allreduce_busbw_gbps: float
    p2p_latency_us: list[list[float | None]]
    p2p_bandwidth_gbps: list[list[float | None]]
    nodes: list[str] = field(default_factory=list)
    node_latency_us: list[list[float | None]] = field(default_factory=list)
    node_bandwidth_gbps: list[list[float | None]] = field(default_factory=list)
    elapsed_s: float = 0.0
    probe_id: str = ""
    measured_at: str = ""
    flops_per_s: list[float] = field(default_factory=list)
    device_links: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    node_facts: dict[str, Any] = field(default_factory=dict)  # node probe: what each node was when measured
    nproc: int | None = None  # node probe: ranks per node

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        d = asdict(self)
        d["sizes"] = list(self.sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TopologyReport:
        """Inverse of ``to_dict`` (keys a newer version added are ignored)."""
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["sizes"] = tuple(d["sizes"])
        return cls(**d)

    def node_index(self, name: str) -> int:
        """Row of node ``name`` in the node matrices (ValueError when the probe did not see it)."""
        return self.nodes.index(name)

    def submatrix(self, names: list[str], which: str = "bandwidth") -> list[list[float | None]]:
        """The node bandwidth (GB/s) or latency (us) matrix restricted to ``names``, in that order."""
        m = self.node_bandwidth_gbps if which == "bandwidth" else self.node_latency_us
        idx = [self.node_index(n) for n in names]
        return [[m[i][j] for j in idx] for i in idx]

    def to_markdown(self) -> str:
        """Markdown tables: collective figures, then the node and rank matrices."""

        def fmt(v: float | None, nd: int) -> str:
            return "—" if v is None else f"{v:.{nd}f}"

        def matrix(title: str, labels: list[str], m: list[list[float | None]], nd: int) -> list[str]:
            out = [f"### {title}", "", "| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
            for lab, row in zip(labels, m, strict=True):
                out.append(f"| {lab} | " + " | ".join(fmt(v, nd) for v in row) + " |")
            return out + [""]

        ranks = [f"r{r}" for r in range(self.world_size)]
        lines = [
            f"# Topology probe ({self.world_size} ranks, {len(self.nodes)} node(s), {self.backend})",
            "",
            f"all_reduce {self.sizes[0]} B: {self.allreduce_latency_us:.1f} us; "
            f"{self.sizes[1]} B: algbw {self.allreduce_algbw_gbps:.3f} GB/s, busbw {self.allreduce_busbw_gbps:.3f} GB/s",
            "",
        ]
        lines += matrix("node latency (us, one way)", self.nodes, self.node_latency_us, 1)
        lines += matrix("node bandwidth (GB/s)", self.nodes, self.node_bandwidth_gbps, 3)
        lines += matrix("rank latency (us, one way)", ranks, self.p2p_latency_us, 1)
        lines += matrix("rank bandwidth (GB/s)", ranks, self.p2p_bandwidth_gbps, 3)
        if self.flops_per_s:
            rates = ", ".join(f"r{r}: {f / 1e9:.2f}" for r, f in enumerate(self.flops_per_s))
            lines += ["### compute (GFLOP/s per rank, all ranks at once)", "", rates, ""]
        for node, links in sorted(self.device_links.items()):
            pairs = links.get("nvlink_pairs") or []
            what = ", ".join(f"GPU{i}-GPU{j} NV{k}" for i, j, k in pairs) if pairs else "no NVLink"
            lines += [f"device links of {node} ({links.get('kind', '?')}): {what}", ""]
        return "\n".join(lines)


def _timed(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds per call of ``fn``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_rank(sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 5) -> dict[str, Any]:
    """Run the probe on this rank of the initialised default group; returns this rank's measurements.

    Every rank must call it. ``row_latency_s[j]``/``row_bandwidth`` hold this rank's pair figures for ``j > rank``.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    small_n = max(1, sizes[0] // 4)
    large_n = max(1, sizes[1] // 4)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    small = torch.ones(small_n, dtype=torch.float32, device=dev)
    large = torch.ones(large_n, dtype=torch.float32, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def ar(t):
        return lambda: (dist.all_reduce(t), sync())

    dist.barrier()
    t_small = _timed(ar(small), iters)
    t_large = _timed(ar(large), max(2, iters // 2), warmup=1)

    row_lat: dict[int, float] = {}
    row_bw: dict[int, float] = {}
    for i in range(world):
        for j in range(i + 1, world):
            dist.barrier()
            if rank not in (i, j):
                continue
            peer = j if rank == i else i

            def pingpong(t, peer=peer, first=(rank == i)):
                if first:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)
                sync()

            rtt_small = _timed(lambda: pingpong(small), iters)
            rtt_large = _timed(lambda: pingpong(large), max(2, iters // 2), warmup=1)
            if rank == i:
                row_lat[j] = rtt_small / 2
                row_bw[j] = large.numel() * 4 / (rtt_large / 2)
    dist.barrier()
    return {
        "rank": rank,
        "world_size": world,
        "hostname": socket.gethostname(),
        "backend": str(dist.get_backend()),
        "allreduce_small_s": t_small,
        "allreduce_large_s": t_large,
        "large_bytes": large.numel() * 4,
        "row_latency_s": row_lat,
        "row_bandwidth_Bps": row_bw,
    }


def assemble_report(
    per_rank: Sequence[dict[str, Any]],
    sizes: Sequence[int],
    iters: int,
    node_of_rank: Sequence[str] | None = None,
    elapsed_s: float = 0.0,
) -> TopologyReport:
    """Combine every rank's ``measure_rank`` output into a ``TopologyReport``."""
    per_rank = sorted(per_rank, key=lambda d: d["rank"])
    n = len(per_rank)
    nodes_by_rank = list(node_of_rank) if node_of_rank else [d["hostname"] for d in per_rank]
    if len(nodes_by_rank) != n:
        raise CommError(f"node_of_rank has {len(nodes_by_rank)} entries for {n} ranks; give one node name per rank")
    lat: list[list[float | None]] = [[None] * n for _ in range(n)]
    bw: list[list[float | None]] = [[None] * n for _ in range(n)]
    for d in per_rank:
        i = d["rank"]
        for j, s in d["row_latency_s"].items():
            lat[i][int(j)] = lat[int(j)][i] = s * 1e6
        for j, b in d["row_bandwidth_Bps"].items():
            bw[i][int(j)] = bw[int(j)][i] = b / 1e9
    nodes = list(dict.fromkeys(nodes_by_rank))
    idx = {name: k for k, name in enumerate(nodes)}
    m = len(nodes)
    nlat: list[list[float | None]] = [[None] * m for _ in range(m)]
    nbw: list[list[float | None]] = [[None] * m for _ in range(m)]
    for i in range(n):
        for j in range(n):
            if i == j or lat[i][j] is None:
                continue
            a, b = idx[nodes_by_rank[i]], idx[nodes_by_rank[j]]
            cur = nlat[a][b]
            nlat[a][b] = lat[i][j] if cur is None else min(cur, lat[i][j])
            curb = nbw[a][b]
            nbw[a][b] = bw[i][j] if curb is None else max(curb, bw[i][j])
    t_small = max(d["allreduce_small_s"] for d in per_rank)
    t_large = max(d["allreduce_large_s"] for d in per_rank)
    large_bytes = per_rank[0]["large_bytes"]
    algbw = large_bytes / t_large / 1e9
    return TopologyReport(
        world_size=n,
        node_of_rank=nodes_by_rank,
        backend=per_rank[0]["backend"],
        sizes=(int(sizes[0]), int(sizes[1])),
        iters=iters,
        allreduce_latency_us=t_small * 1e6,
        allreduce_algbw_gbps=algbw,
        allreduce_busbw_gbps=algbw * 2 * (n - 1) / n if n > 1 else algbw,
        p2p_latency_us=lat,
        p2p_bandwidth_gbps=bw,
        nodes=nodes,
        node_latency_us=nlat,
        node_bandwidth_gbps=nbw,
        elapsed_s=elapsed_s,
        probe_id=uuid.uuid4().hex,
        measured_at=datetime.now(timezone.utc).isoformat(),
    )


def cluster_facts(cfg: Any = None) -> dict[str, Any]:
    """What identifies a cluster for the probe cache: hosts, devices, world size, torch version, backend."""
    import torch

    nodes = setting(cfg, "cluster.nodes", []) or []
    hosts = sorted(str(n.get("host") if isinstance(n, dict) else getattr(n, "host", "")) for n in nodes) or [
        socket.gethostname()
    ]
    gpus_per_node = [int((n.get("gpus") if isinstance(n, dict) else getattr(n, "gpus", 0)) or 0) for n in nodes]
    if torch.cuda.is_available():
        device = {"kind": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    else:
        device = {"kind": "cpu", "count": os.cpu_count()}
    par = setting(cfg, "parallel")
    world = getattr(par, "world_size", None) if par is not None else None
    if world is None and par is not None:
        from kuangchao_core.axes import MeshAxes

        world = MeshAxes.from_parallel(par).world_size
    return {
        "hosts": hosts,
        "gpus_per_node": gpus_per_node,
        "device": device,
        "world_size": int(world or 1),
        "torch": torch.__version__,
        "backend": str(setting(cfg, "parallel.backend", "auto")),
    }


def cluster_fingerprint(cfg: Any = None) -> str:
    """Stable sha256 (hex) of ``cluster_facts(cfg)``: equal for the same cluster, different when it changes."""
    blob = json.dumps(cluster_facts(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def save_report(report: TopologyReport, path: str | os.PathLike) -> Path:
    """Write the report as JSON."""
    p = Path(path)
    p.write_text(json.dumps(report.to_dict(), indent=2))
    return p


def cache_dir() -> Path:
    """Where measured reports are kept for ``kc topology show``: ``$KC_CACHE_DIR/topology`` (default
    ``~/.cache/kuangchao/topology``)."""
    base = machine_cache_dir()
    return base / "topology"


def remember_report(report: TopologyReport, fingerprint: str) -> Path:
    """Keep ``report`` under its cluster fingerprint (atomic write); returns the file."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    data = report.to_dict()
    data["fingerprint"] = fingerprint
    path = d / f"{fingerprint}.json"
    tmp = d / f".{fingerprint}.json.tmp"
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def remembered_reports() -> list[TopologyReport]:
    """Every kept report, newest measurement first (unreadable files are skipped)."""
    out = []
    d = cache_dir()
    for path in d.glob("*.json") if d.is_dir() else []:
        try:
            out.append(TopologyReport.from_dict(json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return sorted(out, key=lambda r: r.measured_at, reverse=True)

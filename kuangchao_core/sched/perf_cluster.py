"""The α–β (latency–bandwidth) side of the step-time model: links, clusters and ring collectives.

A message of ``S`` bytes over a link costs ``α + S·β`` (α: one-way latency in seconds, β: seconds per byte, the
inverse of the bandwidth). Collectives use the ring algorithms whose costs nccl-tests' ``doc/PERFORMANCE.md``
gives (``/work/shared/reference/performance.md`` §2.3), for a group of ``n`` ranks and ``S`` bytes per rank:

- all-reduce: ``2(n−1)/n · S·β + 2(n−1)·α``;
- reduce-scatter and all-gather (``S`` = the whole, gathered tensor): ``(n−1)/n · S·β + (n−1)·α``;
- point-to-point: ``α + S·β``.

A ring takes as long as its slowest hop, so a ring whose group spans several nodes runs at the inter-node link's
α and β (:meth:`ClusterModel.ring_link`). Several rings that leave a node at once share its inter-node links:
with ``f`` flows over ``L`` links each flow sees ``β·max(1, f/L)`` (:meth:`ClusterModel.inter_link`).
The time of computing a reduction or a top-k selection is not counted (a GPU reduces far faster than it sends;
on a CPU, see performance.md §3.2 for the measured top-k cost).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: dense bf16 peak of one H100 SXM / H200 GPU, FLOP/s (performance.md §2.1 and §4)
H100_BF16_PEAK_FLOPS_PER_S = 989.5e12

#: assumed model-FLOPs utilisation of a described GPU cluster: performance.md §4's target for a Llama-style model
#: (peers reach 33–50 %; torchtitan's Llama 3 8B 33–39 % on H100)
DEFAULT_MFU = 0.40


@dataclass(frozen=True)
class LinkModel:
    """One kind of link: ``alpha_s`` one-way latency (s), ``beta_s_per_byte`` inverse bandwidth (s/byte)."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def from_latency_bandwidth(cls, latency_us: float, bandwidth_gbyte_per_s: float) -> LinkModel:
        """α = ``latency_us`` · 1e-6 s; β = 1 / (``bandwidth_gbyte_per_s`` · 1e9) s/byte."""
        if latency_us < 0 or bandwidth_gbyte_per_s <= 0:
            raise ValueError(
                f"latency must be >= 0 and bandwidth > 0, got {latency_us} us and {bandwidth_gbyte_per_s} GB/s"
            )
        return cls(alpha_s=latency_us * 1e-6, beta_s_per_byte=1.0 / (bandwidth_gbyte_per_s * 1e9))

    @property
    def bandwidth_gbyte_per_s(self) -> float:
        """1/β in GB/s (10^9 bytes per second)."""
        return 1.0 / self.beta_s_per_byte / 1e9

    def shared(self, flows_per_link: float) -> LinkModel:
        """The link as each of ``flows_per_link`` concurrent flows sees it: β times that (at least 1)."""
        return LinkModel(self.alpha_s, self.beta_s_per_byte * max(1.0, flows_per_link))


@dataclass(frozen=True)
class ClusterModel:
    """``nodes`` × ``ranks_per_node`` ranks; ``intra`` links inside a node, ``inter`` between nodes.

    ``flops_per_s``: the FLOP rate one rank sustains on the model's matmuls (peak × utilisation);
    ``peak_flops_per_s``: its peak, for MFU (None: MFU is not reported). ``inter_links_per_node``: independent
    inter-node links of a node (a GPU server has one NIC per GPU; a host of the network-namespace bench has one
    shaped link that all its ranks share). Intra-node links are taken as one per rank (NVLink switch).
    """

    nodes: int
    ranks_per_node: int
    intra: LinkModel
    inter: LinkModel
    flops_per_s: float
    name: str = ""
    inter_links_per_node: int = 1
    peak_flops_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.inter_links_per_node < 1:
            raise ValueError(
                f"nodes, ranks_per_node and inter_links_per_node must be >= 1, got {self.nodes}, "
                f"{self.ranks_per_node}, {self.inter_links_per_node}"
            )
        if self.flops_per_s <= 0:
            raise ValueError(f"flops_per_s must be > 0, got {self.flops_per_s}")

    @property
    def world_size(self) -> int:
        """Ranks in the cluster: nodes × ranks_per_node."""
        return self.nodes * self.ranks_per_node

    def with_world_size(self, n_ranks: int) -> ClusterModel:
        """The same kind of cluster with enough nodes for ``n_ranks`` ranks (ranks_per_node unchanged)."""
        nodes = -(-n_ranks // self.ranks_per_node)
        return dataclasses.replace(self, nodes=nodes, name=_renamed(self.name, self.nodes, nodes))

    def inter_link(self, flows_per_node: float) -> LinkModel:
        """The inter-node link as each of ``flows_per_node`` concurrent flows out of one node sees it."""
        return self.inter.shared(flows_per_node / self.inter_links_per_node)

    def ring_link(self, spans_nodes: bool, flows_per_node: float = 1.0) -> LinkModel:
        """The link that bounds a ring: the inter-node one (shared by the flows) when the group spans nodes."""
        return self.inter_link(flows_per_node) if spans_nodes else self.intra

    @classmethod
    def from_topology(
        cls,
        report: Any,
        flops_per_s: float | None = None,
        ranks_per_node: int | None = None,
        inter_links_per_node: int = 1,
        peak_flops_per_s: float | None = None,
        name: str | None = None,
    ) -> ClusterModel:
        """Calibrate from a topology probe report (``TopologyReport`` or its ``to_dict()``).

        α is the measured one-way latency (``node_latency_us``), β the inverse of the measured bandwidth
        (``node_bandwidth_gbps``, GB/s). ``intra`` comes from the diagonal (the worst node: highest latency,
        lowest bandwidth), ``inter`` from the off-diagonal entries (the worst pair, latency and bandwidth each
        taken at their worst). With one node the inter link equals the intra one; with one rank per node (no
        diagonal) the intra link equals the inter one. ``ranks_per_node`` defaults to the most ranks the report
        places on one node (``node_of_rank``). The probe times one pair at a time, so a host's shared link is
        modelled by ``inter_links_per_node`` (default 1). ``flops_per_s`` defaults to the slowest rank's rate in
        the report's ``flops_per_s`` list (measured with all ranks computing at once), when it has one.
        """
        d = report.to_dict() if hasattr(report, "to_dict") else dict(report)
        if flops_per_s is None:
            rates = [f for f in d.get("flops_per_s") or [] if f]
            if not rates:
                raise ValueError("give flops_per_s: the topology report holds no measured FLOP rate")
            flops_per_s = min(rates)
        lat = d.get("node_latency_us") or []
        bw = d.get("node_bandwidth_gbps") or []
        m = len(lat)
        diag = [(lat[i][i], bw[i][i]) for i in range(m) if lat[i][i] is not None and bw[i][i] is not None]
        off = [
            (lat[i][j], bw[i][j])
            for i in range(m)
            for j in range(m)
            if i != j and lat[i][j] is not None and bw[i][j] is not None
        ]
        if not diag and not off:
            raise ValueError("the topology report holds no node latency/bandwidth figures (node_* matrices empty)")

        def worst(pairs: list[tuple[float, float]]) -> LinkModel:
            return LinkModel.from_latency_bandwidth(max(p[0] for p in pairs), min(p[1] for p in pairs))

        intra = worst(diag) if diag else worst(off)
        inter = worst(off) if off else intra
        node_of_rank = list(d.get("node_of_rank") or [])
        if ranks_per_node is None:
            counts = [node_of_rank.count(x) for x in dict.fromkeys(node_of_rank)]
            ranks_per_node = max(counts) if counts else 1
        nodes = max(m, 1)
        return cls(
            nodes=nodes,
            ranks_per_node=ranks_per_node,
            intra=intra,
            inter=inter,
            flops_per_s=flops_per_s,
            name=name or f"probed {nodes} node(s) x {ranks_per_node} ({d.get('backend', '?')})",
            inter_links_per_node=inter_links_per_node,
            peak_flops_per_s=peak_flops_per_s,
        )

    @classmethod
    def described(
        cls,
        nodes: int,
        gpus_per_node: int = 8,
        intra_gbyte_per_s: float = 450.0,
        inter_gbit_per_s: float = 400.0,
        intra_latency_us: float = 2.0,
        inter_latency_us: float = 5.0,
        peak_flops_per_s: float = H100_BF16_PEAK_FLOPS_PER_S,
        mfu: float = DEFAULT_MFU,
        name: str | None = None,
    ) -> ClusterModel:
        """A described GPU cluster: ``nodes`` × ``gpus_per_node`` H100/H200-class GPUs.

        Inside a node NVLink at ``intra_gbyte_per_s`` GB/s per GPU and direction (H100/H200 NVLink 4: 900 GB/s
        both directions, performance.md §4); between nodes one NIC per GPU at ``inter_gbit_per_s`` Gb/s
        (200 or 400 Gb/s InfiniBand/RoCE: 25 or 50 GB/s). The latencies are assumptions of the usual order
        (a few µs per NVLink hop, ~5 µs per network hop), not measurements. Each GPU sustains
        ``peak_flops_per_s`` × ``mfu``: dense bf16 989.5 TFLOP/s at an assumed 40 % MFU (performance.md §4's
        target; torchtitan's Llama 3 8B reaches 33–39 %), i.e. 395.8 TFLOP/s.
        """
        return cls(
            nodes=nodes,
            ranks_per_node=gpus_per_node,
            intra=LinkModel.from_latency_bandwidth(intra_latency_us, intra_gbyte_per_s),
            inter=LinkModel.from_latency_bandwidth(inter_latency_us, inter_gbit_per_s / 8.0),
            flops_per_s=peak_flops_per_s * mfu,
            name=name
            or f"{nodes} node(s) x {gpus_per_node} GPUs, NVLink {intra_gbyte_per_s:g} GB/s, {inter_gbit_per_s:g} Gb/s",
            inter_links_per_node=gpus_per_node,
            peak_flops_per_s=peak_flops_per_s,
        )


def _renamed(name: str, old_nodes: int, new_nodes: int) -> str:
    prefix = f"{old_nodes} node(s)"
    return f"{new_nodes} node(s){name[len(prefix) :]}" if name.startswith(prefix) else name


# ---- ring collectives (nccl-tests doc/PERFORMANCE.md; performance.md §2.3) ----


def all_reduce_s(size_bytes: float, n: int, link: LinkModel) -> float:
    """Ring all-reduce of ``size_bytes`` per rank over ``n`` ranks: ``2(n−1)/n·S·β + 2(n−1)·α`` (0 when n = 1)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * size_bytes * link.beta_s_per_byte + 2 * (n - 1) * link.alpha_s


def reduce_scatter_s(size_bytes: float, n: int, link: LinkModel) -> float:
    """Ring reduce-scatter of ``size_bytes`` (the unscattered tensor): ``(n−1)/n·S·β + (n−1)·α``."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * size_bytes * link.beta_s_per_byte + (n - 1) * link.alpha_s


def all_gather_s(size_bytes: float, n: int, link: LinkModel) -> float:
    """Ring all-gather into ``size_bytes`` (the gathered tensor, n chunks): ``(n−1)/n·S·β + (n−1)·α``."""
    return reduce_scatter_s(size_bytes, n, link)


def p2p_s(size_bytes: float, link: LinkModel) -> float:
    """One point-to-point message: ``α + S·β``."""
    return link.alpha_s + size_bytes * link.beta_s_per_byte


def all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce: ``2(n−1)/n·S``."""
    return 2 * (n - 1) / n * size_bytes if n > 1 else 0.0


def gather_bytes(size_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter or all-gather of ``size_bytes``: ``(n−1)/n·S``."""
    return (n - 1) / n * size_bytes if n > 1 else 0.0


def hierarchical_all_reduce_s(size_bytes: float, k: int, n_nodes: int, intra: LinkModel, inter: LinkModel) -> float:
    """Two-level all-reduce of ``size_bytes`` over ``k`` ranks per node on ``n_nodes`` nodes.

    Reduce-scatter inside the node (``k`` ranks, intra link), all-reduce of each ``S/k`` shard across the nodes
    (``n_nodes`` ranks, inter link), all-gather inside the node:
    ``RS(S, k, intra) + AR(S/k, n_nodes, inter) + AG(S, k, intra)``.
    """
    return (
        reduce_scatter_s(size_bytes, k, intra)
        + all_reduce_s(size_bytes / k, n_nodes, inter)
        + all_gather_s(size_bytes, k, intra)
    )

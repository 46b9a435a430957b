"""Links between the GPUs of one node, as ``nvidia-smi topo -m`` prints them (SPEC L4.2).

``parse_topo_matrix`` reads the matrix part of that output::

            GPU0    GPU1    GPU2    GPU3    CPU Affinity ...
    GPU0     X      NV18    NV18    SYS     0-55
    GPU1    NV18     X      SYS     NV18    0-55

``NV<k>`` means k NVLinks between the pair; ``PIX``, ``PXB``, ``PHB``, ``NODE`` and ``SYS`` are PCIe paths of
growing length. :func:`link_rank` orders them (more NVLinks first), :func:`device_chain` orders the devices so
consecutive ones share the best links (the local slot order of the node-level placement).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

_PCIE_ORDER = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}


def parse_topo_matrix(text: str) -> dict[str, Any]:
    """``{"gpus": [names], "links": [[str]], "nvlink_pairs": [[i, j, k]]}`` from ``nvidia-smi topo -m`` output."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s+GPU0\b", ln)), None)
    if header is None:
        return {"gpus": [], "links": [], "nvlink_pairs": []}
    gpus = [c for c in header.split() if re.fullmatch(r"GPU\d+", c)]
    links: list[list[str]] = []
    for ln in lines:
        if ln is header:
            continue
        cells = ln.split()
        if cells and cells[0] in gpus and len(cells) > len(gpus):
            links.append(cells[1 : 1 + len(gpus)])
    pairs = []
    for i, row in enumerate(links):
        for j, cell in enumerate(row):
            m = re.fullmatch(r"NV(\d+)", cell)
            if j > i and m:
                pairs.append([i, j, int(m.group(1))])
    return {"gpus": gpus, "links": links, "nvlink_pairs": pairs}


def read_nvidia_smi_topo(timeout_s: float = 20.0) -> dict[str, Any]:
    """The parsed matrix of this machine (empty when ``nvidia-smi`` is missing or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"gpus": [], "links": [], "nvlink_pairs": [], "error": "nvidia-smi not found"}
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"gpus": [], "links": [], "nvlink_pairs": [], "error": f"nvidia-smi topo -m: {exc}"}
    return parse_topo_matrix(out.stdout)


def link_rank(cell: str) -> int:
    """Sort key of one link (smaller is faster): ``NV<k>`` → −k, PCIe paths 1..5, unknown 9."""
    m = re.fullmatch(r"NV(\d+)", cell or "")
    if m:
        return -int(m.group(1))
    return _PCIE_ORDER.get(cell, 9)


def device_chain(links: list[list[str]], count: int) -> list[int]:
    """Local slots ``0..count-1`` ordered so that each next device has the best link to the previous one."""
    if not links or len(links) < count:
        return list(range(count))
    order, left = [0], set(range(1, count))
    while left:
        here = order[-1]
        nxt = min(left, key=lambda j: (link_rank(links[here][j]), j))
        order.append(nxt)
        left.remove(nxt)
    return order

"""A dump of every group's state and a cross-rank consistency check (SPEC L2.4, ``kc debug comm``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kuangchao_core.comm.registry import all_groups


def dump_groups() -> list[dict]:
    """This process's groups: ``name``, ``ranks`` (in the caller's order), ``backend``, ``kind`` (device or host),
    ``timeout_ms``, ``member``, ``ops`` (issued per op kind), ``ops_issued`` (total), ``last_seq`` (collectives),
    ``p2p``, ``broken``.
    """
    out = []
    for g in all_groups():
        out.append(
            {
                "name": g.name,
                "ranks": list(g.ranks),
                "backend": g.backend,
                "kind": g.kind,
                "timeout_ms": g.timeout_ms,
                "member": g.is_member,
                "ops": dict(g.ops),
                "ops_issued": sum(g.ops.values()),
                "last_seq": g.seq,
                "p2p": {str(k): v for k, v in g.p2p.items()},
                "broken": g.broken,
            }
        )
    return out


def write_dump(path: str | os.PathLike, rank: int | None = None) -> Path:
    """Write ``{"rank": r, "groups": dump_groups()}`` as JSON to ``path`` (read by ``kc debug comm``)."""
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"rank": rank, "groups": dump_groups()}, indent=1))
    return p


def check_consistency(dumps: dict[int, list[dict]] | list[list[dict]]) -> list[str]:
    """Compare the dumps of all ranks; return one line per problem found (empty list: consistent).

    ``dumps`` maps rank -> ``dump_groups()`` of that rank (a list indexed by rank also works). Reported:
    a group constructed on some ranks only, a group whose rank order or backend differs between ranks,
    members that issued a different number of collectives (the laggards of a hang), and groups of one job
    using different backends (mixed backends).
    """
    if not isinstance(dumps, dict):
        dumps = dict(enumerate(dumps))
    problems: list[str] = []
    by_name: dict[str, dict[int, dict]] = {}
    order: list[str] = []
    for rank, groups in sorted(dumps.items()):
        for entry in groups:
            if entry["name"] not in by_name:
                order.append(entry["name"])
            by_name.setdefault(entry["name"], {})[rank] = entry
    all_ranks = sorted(dumps)
    for name in order:
        views = by_name[name]
        absent = [r for r in all_ranks if r not in views]
        if absent:
            problems.append(f"group {name!r}: not constructed on ranks {absent} (constructed on {sorted(views)})")
        rank_lists = {tuple(v["ranks"]) for v in views.values()}
        if len(rank_lists) > 1:
            detail = "; ".join(f"rank {r}: {v['ranks']}" for r, v in sorted(views.items()))
            problems.append(f"group {name!r}: inconsistent rank order between ranks ({detail})")
        backends = {v["backend"] for v in views.values()}
        if len(backends) > 1:
            detail = "; ".join(f"rank {r}: {v['backend']}" for r, v in sorted(views.items()))
            problems.append(f"group {name!r}: mixed backends between ranks ({detail})")
        members = {r: v for r, v in views.items() if v.get("member", r in v["ranks"])}
        seqs = {r: v["last_seq"] for r, v in members.items()}
        if len(set(seqs.values())) > 1:
            top = max(seqs.values())
            behind = sorted(r for r, s in seqs.items() if s < top)
            problems.append(
                f"group {name!r}: members issued different numbers of collectives ({seqs}); "
                f"ranks {behind} are behind (last_seq < {top})"
            )
    group_backends = {}
    for name in order:
        for v in by_name[name].values():
            group_backends.setdefault(v["backend"], []).append(name)
    if len(group_backends) > 1:
        detail = "; ".join(f"{b}: {sorted(set(ns))}" for b, ns in sorted(group_backends.items()))
        problems.append(f"mixed backends across groups ({detail})")
    return problems


def load_dumps(paths) -> dict[int, list[dict]]:
    """Read dump files written by ``write_dump`` into ``{rank: groups}``."""
    out: dict[int, list[dict]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        out[int(data["rank"])] = data["groups"]
    return out

"""The orchestrator's verdict on the nodes of one multi-node attempt, from the files each node's launcher keeps.

Every node of an attempt (a node agent's share, :mod:`.node_share`, or a Slurm task, :mod:`.slurm.node`) beats in
``attempt_<n>/nodes/<node>/agent.json`` and ends with ``result.json``. :class:`AttemptWatch` reads them:

- every node reports ``ok`` → the attempt succeeded;
- a node reports a failure → the other nodes are stopped (``attempt_<n>/stop``) and the failure is raised as
  ``WorkerFailed`` with its rank and cause — unless a node is found lost meanwhile. A failure whose ranks only saw
  a peer's connection drop (Gloo's "Connection closed by peer" / "Connection reset by peer", see
  :func:`peer_dropped`) names a victim, not the culprit: a node that failed for a reason of its own comes first;
- a node's launcher stops beating without a result (its machine died or was cut off), or never starts → the node
  is **lost**: the others are stopped and ``WorkerFailed(node=...)`` names it so that recovery leaves it out. Once
  another node reported a failure (its ranks saw their peers' connections drop, or its torchrun exited), a launcher
  silent for :data:`PEER_SILENT_AFTER_S` counts as lost at once; the heartbeat limit (``lost_after``) is the
  fall-back when nothing else failed (a cut cable that no rank notices). A node whose torchrun was killed by a
  signal without a worker failure report (all its ranks gone with it) is lost as well.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuangchao_core.errors import WorkerFailed
from kuangchao_core.sched.node_share import AGENT_BEAT, RESULT, node_dir, read_json, stop_path

#: once the attempt is failing (a node reported), how long a node's launcher (it beats every 0.5 s) may stay silent
#: before the node counts as lost: the surviving ranks already saw its connections drop, no need for the full limit
PEER_SILENT_AFTER_S = 3.0
#: what Gloo (and NCCL's socket transport) say when the process at the other end of a connection died
_PEER_DROP = re.compile(
    r"connection (closed|reset) by peer|connection reset|broken pipe|socket closed|remote process exited",
    re.IGNORECASE,
)
_STOPPED = "stopped by the orchestrator"


def peer_dropped(cause: str | None) -> bool:
    """Whether a failure's ``cause`` is a rank seeing its peer's connection drop (the peer died, not this rank)."""
    return bool(cause) and _PEER_DROP.search(str(cause)) is not None


def _torchrun_killed(result: dict[str, Any]) -> bool:
    """A node's result saying its torchrun died from a signal without a worker failure report (its ranks with it)."""
    code = result.get("exit_code")
    return (
        result.get("rank") is None
        and isinstance(code, int)
        and code < 0
        and "without a worker failure report" in str(result.get("cause", ""))
    )


@dataclass
class NodeWatch:
    """What the orchestrator knows of one node of the attempt (``handle``: its node-agent flow run, if any)."""

    handle: Any = None
    counter: int | None = None
    changed_at: float = 0.0
    result: dict[str, Any] | None = None


class AttemptWatch:
    """The nodes ``names`` of attempt ``attempt`` of ``run_dir``, judged by :meth:`check` (see the module's doc).

    ``lost_after`` is how long a node's launcher may stay silent before the node counts as lost, ``start_timeout``
    how long it may take to start beating; ``on_lost(name, why, handle)`` runs before a lost node is raised."""

    def __init__(
        self,
        run_dir: str | Path,
        attempt: int,
        names: Iterable[str] = (),
        *,
        lost_after: float,
        start_timeout: float,
        on_lost: Callable[[str, str, Any], None] | None = None,
    ):
        self.run_dir, self.attempt = Path(run_dir), attempt
        self.lost_after, self.start_timeout, self.on_lost = lost_after, start_timeout, on_lost
        self.t0 = time.monotonic()
        self.nodes: dict[str, NodeWatch] = {}
        for name in names:
            self.add(name)

    @property
    def stop(self) -> Path:
        """The attempt's stop file: every node's launcher stops its ranks once it exists."""
        return stop_path(self.run_dir, self.attempt)

    def add(self, name: str, handle: Any = None) -> None:
        """Watch node ``name`` from now on."""
        self.nodes[name] = NodeWatch(handle, changed_at=time.monotonic())

    def watch(self, poll_s: float) -> None:
        """:meth:`check` every ``poll_s`` seconds until every node succeeded; raises ``WorkerFailed``."""
        while True:
            time.sleep(poll_s)
            if self.check(poll_s):
                return

    def check(self, poll_s: float = 0.2) -> bool:
        """True once every node reported ``ok``, False while none failed or was lost; otherwise the other nodes
        are stopped, the others' reports waited for a little, and the culprit raised as ``WorkerFailed``."""
        self._poll()
        failed = self._failed()
        # a node that reported a failure (its ranks saw a peer drop, or its torchrun exited): the attempt is
        # failing, and a node that went silent meanwhile is the one whose ranks died
        lost = self._lost(PEER_SILENT_AFTER_S if failed else None)
        if self.nodes and all(w.result is not None and w.result.get("ok") for w in self.nodes.values()):
            return True
        if not lost and not failed:
            return False
        self.stop.parent.mkdir(parents=True, exist_ok=True)
        self.stop.write_text(f"attempt {self.attempt} failed on {(lost or failed)[0][0]}", encoding="utf-8")
        # give the others the time to report (or to be found lost as well) before naming the culprit
        deadline = time.monotonic() + min(self.lost_after, PEER_SILENT_AFTER_S) + 5
        while time.monotonic() < deadline and not lost:
            time.sleep(poll_s)
            self._poll()
            lost = self._lost(PEER_SILENT_AFTER_S)
            if all(w.result is not None for w in self.nodes.values()):
                break
        if lost:
            name, why = lost[0]
            if self.on_lost is not None:
                self.on_lost(name, why, self.nodes[name].handle)
            raise WorkerFailed(None, f"lost: {why}", node=name)
        real = [(n, r) for n, r in self._failed() if not str(r.get("cause", "")).startswith(_STOPPED)]
        own = [(n, r) for n, r in real if not peer_dropped(r.get("cause"))]  # victims of a peer's death come last
        name, res = (own or real or self._failed())[0]
        raise WorkerFailed(res.get("rank"), f"on node {name}: {res.get('cause')}", res.get("exit_code"))

    def _poll(self) -> None:
        now = time.monotonic()
        for name, w in self.nodes.items():
            out = node_dir(self.run_dir, self.attempt, name)
            if w.result is None:
                w.result = read_json(out / RESULT)
            beat = read_json(out / AGENT_BEAT)
            counter = beat.get("counter") if beat else None
            if counter is not None and counter != w.counter:
                w.counter, w.changed_at = counter, now

    def _lost(self, silent_after: float | None = None) -> list[tuple[str, str]]:
        """Nodes lost now, with why: no launcher beat within ``start_timeout``; a launcher silent for
        ``lost_after`` (or ``silent_after`` once the attempt is failing); a torchrun killed with no failure report."""
        now = time.monotonic()
        limit = min(self.lost_after, silent_after) if silent_after is not None else self.lost_after
        out = []
        for name, w in self.nodes.items():
            if w.result is not None:
                if not w.result.get("ok") and _torchrun_killed(w.result):
                    out.append((name, f"its torchrun died ({w.result.get('cause')})"))
                continue
            if w.counter is None and now - self.t0 > self.start_timeout:
                out.append((name, f"its launcher did not start the node's share within {self.start_timeout:g} s"))
            elif w.counter is not None and now - w.changed_at > limit:
                silent = now - w.changed_at
                if limit < self.lost_after:
                    why = f"its launcher and ranks went silent for {silent:.1f} s while its peers' connections to it dropped"
                else:
                    why = f"its launcher and ranks went silent for {silent:.1f} s (limit {self.lost_after:g} s)"
                out.append((name, why))
        return out

    def _failed(self) -> list[tuple[str, dict[str, Any]]]:
        return [(n, w.result) for n, w in self.nodes.items() if w.result is not None and not w.result.get("ok")]

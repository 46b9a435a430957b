"""One node's share of a multi-node attempt: what the orchestrator asks a node agent to run, and how it runs it.

The orchestrator (:mod:`kuangchao_core.sched.multinode`) sends each node a :class:`NodeShare` as the parameters of
a node-agent flow run; the agent calls :func:`run_node_share`, which runs ``torch.distributed.run`` for the node's
ranks (c10d rendezvous on the first node, the node's own address) through the one launcher
(:func:`~kuangchao_core.sched.launcher.run_workers`). The run directory is on storage every node shares (as the
checkpoints are). Under ``attempt_<n>/nodes/<node>/`` the share leaves:

- ``agent.json``: the agent's own beat (``counter``, rewritten every ``beat_interval_s``) — a node whose agent
  stops beating without a result was lost with its machine;
- ``result.json``: ``{"ok": true}`` or the failure (rank, cause, exit code) once torchrun is done;
- ``launcher.log`` and ``logs/``: the node's torchrun output, which the orchestrator tails into the live view.

Rank heartbeats go to the attempt's shared ``heartbeat/`` directory, as on one node. An ``attempt_<n>/stop`` file
makes every node stop its ranks (the orchestrator gave up on the attempt); so does ``attempt_<n>/orchestrator.json``,
the orchestrator's own beat, when it stops changing for ``owner_lost_after_s`` (the orchestrator died: its ranks
must not go on writing the lineage).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kuangchao_core.errors import WorkerFailed
from kuangchao_core.sched.launch_spec import LaunchSpec
from kuangchao_core.sched.launcher import run_workers

ENV_TOKENS = "KC_TOKENS"
ENV_TOKEN_BUNDLE = "KC_TOKEN_BUNDLE"
AGENT_BEAT = "agent.json"
OWNER_BEAT = "orchestrator.json"
RESULT = "result.json"
STOP = "stop"


@dataclass
class NodeShare:
    """Everything one node needs to run its ranks of one attempt (JSON values only: flow-run parameters)."""

    run_dir: str
    attempt: int
    node: str
    node_rank: int
    nnodes: int
    nproc: int
    rdzv_host: str
    rdzv_port: int
    rdzv_id: str
    local_addr: str
    ifname: str | None
    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    heartbeat_timeout_s: float | None = None
    heartbeat_interval_s: float = 1.0
    beat_interval_s: float = 0.5
    owner_lost_after_s: float | None = None

    @property
    def ranks(self) -> list[int]:
        """Global ranks this node hosts (nodes are ranked in the order the rendezvous sorts them)."""
        return [self.node_rank * self.nproc + i for i in range(self.nproc)]

    def to_params(self) -> dict[str, Any]:
        """Flow-run parameters."""
        return asdict(self)


def node_dir(run_dir: str | os.PathLike, attempt: int, node: str) -> Path:
    """``attempt_<n>/nodes/<node>/`` of a run."""
    return Path(run_dir) / f"attempt_{attempt}" / "nodes" / node


def owner_beat_path(run_dir: str | os.PathLike, attempt: int) -> Path:
    """The orchestrator's beat file of an attempt (its agents stop their ranks when it goes silent)."""
    return Path(run_dir) / f"attempt_{attempt}" / OWNER_BEAT


def stop_path(run_dir: str | os.PathLike, attempt: int) -> Path:
    """The file whose appearance stops every node's ranks of an attempt."""
    return Path(run_dir) / f"attempt_{attempt}" / STOP


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A share file read back (None while absent or half-written)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class Beat(threading.Thread):
    """Rewrites ``{"pid", "counter"}`` to ``path`` every ``interval_s`` until ``halt`` is set: a process's sign of
    life that a reader on any node compares with its own earlier reading (no clocks compared)."""

    def __init__(self, path: Path, interval_s: float):
        super().__init__(daemon=True, name="kc-node-agent-beat")
        self.path, self.interval_s = path, interval_s
        self.halt = threading.Event()

    def run(self) -> None:
        counter = 0
        while not self.halt.is_set():
            counter += 1
            _write_json(self.path, {"pid": os.getpid(), "counter": counter})
            self.halt.wait(self.interval_s)


def take_token_bundle(env: dict[str, str]) -> dict[str, str]:
    """Replace ``KC_TOKEN_BUNDLE`` (a file of this node's tokens, written by the orchestrator because flow-run
    parameters are stored by Prefect) by ``KC_TOKENS`` with its content, and delete the file."""
    path = env.get(ENV_TOKEN_BUNDLE)
    if not path:
        return env
    out = {k: v for k, v in env.items() if k != ENV_TOKEN_BUNDLE}
    bundle = Path(path)
    out[ENV_TOKENS] = bundle.read_text()
    bundle.unlink(missing_ok=True)
    return out


@contextlib.contextmanager
def reporting(out: Path, beat_interval_s: float) -> Iterator[dict[str, Any]]:
    """A node's launcher at work: it beats in ``out/agent.json`` while the block runs, and ``out/result.json`` says
    how the block ended — a failure (``WorkerFailed``'s rank, cause and exit code; re-raised), or ``ok`` with what
    the block put in the dict it was given."""
    beat = Beat(out / AGENT_BEAT, beat_interval_s)
    beat.start()
    done: dict[str, Any] = {}
    try:
        yield done
    except WorkerFailed as exc:
        _write_json(out / RESULT, {"ok": False, "rank": exc.rank, "cause": exc.cause, "exit_code": exc.exit_code})
        raise
    except BaseException as exc:
        _write_json(out / RESULT, {"ok": False, "rank": None, "cause": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        beat.halt.set()
    _write_json(out / RESULT, {"ok": True, **done})


def run_node_share(share: NodeShare) -> dict[str, Any]:
    """Run this node's ranks to the end; writes ``result.json`` and re-raises a failure as ``WorkerFailed``."""
    out = node_dir(share.run_dir, share.attempt, share.node)
    out.mkdir(parents=True, exist_ok=True)
    env = take_token_bundle({**os.environ, **share.env, "KC_NODE": share.node})  # tokens: file -> env, file gone
    if share.ifname:
        env.setdefault("GLOO_SOCKET_IFNAME", share.ifname)
        env.setdefault("NCCL_SOCKET_IFNAME", share.ifname)
    with reporting(out, share.beat_interval_s) as done:
        result = run_workers(
            LaunchSpec(
                share.module,
                share.args,
                nproc=share.nproc,
                env=env,
                run_dir=Path(share.run_dir),
                heartbeat_timeout_s=share.heartbeat_timeout_s,
                heartbeat_interval_s=share.heartbeat_interval_s,
                attempt=share.attempt,
                nnodes=share.nnodes,
                node_rank=share.node_rank,
                master_addr=share.rdzv_host,
                master_port=share.rdzv_port,
                rdzv_id=share.rdzv_id,
                local_addr=share.local_addr,
                rdzv_is_host=share.node_rank == 0,
                out_dir=out,
                stop_file=stop_path(share.run_dir, share.attempt),
                owner_beat=owner_beat_path(share.run_dir, share.attempt) if share.owner_lost_after_s else None,
                owner_lost_after_s=share.owner_lost_after_s or 10.0,
            )
        )
        done["duration_s"] = result.duration_s
    return {"ok": True, "node": share.node, "duration_s": result.duration_s}

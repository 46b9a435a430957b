"""The lifeline between a launcher and its ranks: each rank's tokens handed to that rank alone, and ranks that stop
when their launcher dies.

The launcher (:func:`~kuangchao_core.sched.launcher.run_workers`, ``kc launch``) serves a Unix socket in a private
directory (mode 0700, outside the run directory) and gives the ranks its path in ``KC_LIFELINE`` instead of the
tokens. A rank connects once at start (:func:`connect`) and keeps the connection:

- **Tokens**: the launcher identifies the peer by the kernel (``SO_PEERCRED``), accepts only a process of the
  worker tree it started, reads the rank from that process's own start-up environment (``RANK``, as torchrun set
  it; mapped through ``KC_RANK_MAP`` to the mesh rank) and answers with that rank's tokens (``<module>-<rank>``),
  once. So no rank's ``/proc/<pid>/environ`` holds a token, and each process only ever receives its own.
- **Life**: when the launcher's process ends — ``kill -9`` included — the kernel closes its end; the rank's watcher
  thread reads end-of-file and ends the rank's process within a moment (exit code :data:`EXIT_ORPHANED`). A rank
  never outlives the process that owns its job.

Wire format: the launcher sends one JSON line ``{"tokens": {...}}`` (or ``{"error": "..."}``) after the connection
is accepted; nothing else is ever sent.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ENV_LIFELINE = "KC_LIFELINE"
#: a rank's exit code when its launcher's lifeline closed (EX_TEMPFAIL)
EXIT_ORPHANED = 75
_MAX_REPLY = 1 << 20
logger = logging.getLogger("kuangchao.sched")


def _peer_pid(conn: socket.socket) -> int:
    pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def _start_environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _ancestors(pid: int) -> list[int]:
    out = []
    for _ in range(64):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            break
        pid = int(stat[stat.rfind(")") + 2 :].split()[1])
        if pid <= 1:
            break
        out.append(pid)
    return out


def split_tokens(tokens: dict[str, str]) -> dict[int, dict[str, str]]:
    """``{"worker-3": t, "data_loader-3": u, ...}`` by rank: ``{3: {"worker-3": t, "data_loader-3": u}}``. Tokens of
    modules that are not a rank's (``monitor`` …) belong to no rank and are left out."""
    out: dict[int, dict[str, str]] = {}
    for module, token in tokens.items():
        _, sep, tail = module.rpartition("-")
        if sep and tail.isdigit():
            out.setdefault(int(tail), {})[module] = token
    return out


class Lifeline:
    """The launcher's side: serves ``tokens`` (module -> token, every local rank's) to the processes below
    ``root_pid`` (set with :meth:`watch` once the worker tree is started) and holds every connection until
    :meth:`close`. ``rank_map``: the mesh rank of each torchrun rank (None: the same)."""

    def __init__(self, tokens: dict[str, str] | None = None, rank_map: list[int] | None = None):
        self._by_rank = split_tokens(tokens or {})
        self._rank_map = rank_map
        self._root_pid: int | None = None
        self._root_set = threading.Event()
        self._dir = Path(tempfile.mkdtemp(prefix="kc-lifeline-"))
        os.chmod(self._dir, 0o700)
        self.path = str(self._dir / "s")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(256)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.claimed: dict[int, int] = {}  # mesh rank -> pid that received its tokens
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kc-lifeline")
        self._thread.start()

    def env(self) -> dict[str, str]:
        """What the ranks' environment needs: ``KC_LIFELINE``."""
        return {ENV_LIFELINE: self.path}

    def watch(self, root_pid: int) -> None:
        """Accept only processes below ``root_pid`` (torchrun's pid) from now on."""
        self._root_pid = root_pid
        self._root_set.set()

    def _reply_for(self, conn: socket.socket) -> dict:
        pid = _peer_pid(conn)
        if not self._root_set.wait(30):
            return {"error": "the launcher did not start its workers"}
        if self._root_pid not in _ancestors(pid):
            return {"error": f"process {pid} is not one of this launcher's workers"}
        env = _start_environment(pid)
        if not env.get("RANK", "").isdigit():
            return {"error": f"process {pid} has no RANK in its start-up environment"}
        rank = int(env["RANK"])
        if self._rank_map is not None and 0 <= rank < len(self._rank_map):
            rank = int(self._rank_map[rank])
        with self._lock:
            if rank in self.claimed:
                return {"error": f"the tokens of rank {rank} were already handed to process {self.claimed[rank]}"}
            self.claimed[rank] = pid
            return {"tokens": self._by_rank.pop(rank, {}), "rank": rank}

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            try:
                reply = self._reply_for(conn)
            except OSError as exc:  # the peer vanished while it was checked
                reply = {"error": f"could not identify the peer ({exc})"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._conns.append(conn)

    def close(self) -> None:
        """Close every rank's lifeline (ranks still running end) and remove the socket's directory."""
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
            self._by_rank.clear()
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        for c in conns:
            try:
                c.close()
            except OSError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Lifeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > _MAX_REPLY:
            raise OSError("the launcher's reply is too long")
    return buf


def _orphaned(rank: str) -> None:
    sys.stderr.write(
        f"kuangchao: rank {rank}: the launcher that owns this job is gone (its lifeline closed); stopping this rank\n"
    )
    sys.stderr.flush()
    os._exit(EXIT_ORPHANED)


_HELD: list[socket.socket] = []


def connect(on_lost: Callable[[str], None] | None = None) -> dict[str, str] | None:
    """A rank's side: connect to ``$KC_LIFELINE`` (removed from the environment), return this rank's tokens, and
    keep the connection, watched by a daemon thread that ends the process when the launcher is gone (``on_lost``
    replaces that, for tests). None when there is no lifeline; a ``RuntimeError`` when the launcher refused."""
    path = os.environ.pop(ENV_LIFELINE, None)
    if not path:
        return None
    rank = os.environ.get("RANK", "?")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    reply = json.loads(_read_line(sock) or b"{}")
    if "error" in reply:
        sock.close()
        raise RuntimeError(f"rank {rank}: the launcher refused this process its tokens: {reply['error']}")
    _HELD.append(sock)

    def watch() -> None:
        while True:
            try:
                data = sock.recv(4096)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                break
        (on_lost or _orphaned)(rank)

    threading.Thread(target=watch, daemon=True, name="kc-lifeline-watch").start()
    return {str(k): str(v) for k, v in (reply.get("tokens") or {}).items()}


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The ones of ``pids`` still alive after up to ``timeout_s`` (for tests and shutdown checks)."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if is_alive(p)]
        if alive:
            time.sleep(0.1)
    return alive


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(") ", 1)[1][:1] not in ("Z", "X")
    except (OSError, IndexError):
        return False

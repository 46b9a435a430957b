"""NCCL's execution replayed on CPU: would these ranks' device-group operations finish on GPUs? (``KC_COMM_RULES``)

Gloo runs every operation as soon as both sides call it; NCCL does not. Each rank's trace
(:mod:`kuangchao_core.comm.stream_trace`) lists, in the order its host issued them: operations on device groups,
waits (the compute stream waits for an operation: ``handle.wait()`` on NCCL does not block the host), host syncs
(``.item()``, ``.cpu()``: the host waits for the compute stream) and host-group operations (Gloo, blocking the host
until the peers arrive). :class:`StreamReplay` runs them under NCCL's rules (``../shared/reference/nccl.md``):

- a communicator runs its operations in issue order on one stream: a group's collectives and grouped batches
  (``batch_isend_irecv``, which torch issues on the group's own communicator) on the group's stream; a rank pair's
  single sends *and* receives on the pair's stream (torch's NCCL process group keys them ``low:high``);
- an operation starts once it heads its stream and the compute stream has passed every wait issued before it
  (torch makes the NCCL stream wait for the compute stream when it issues an operation);
- a collective completes when every member has started it (the n-th collective of a group on each member);
- a send and its receive complete together once both have started (NCCL ignores tags: the k-th send from A to B on
  a communicator pairs with B's k-th receive from A); a send is a rendezvous, as large messages are on NCCL;
- a grouped batch completes when each of its sends and receives has found its partner started;
- a host sync blocks the host until the compute stream has passed every wait before it; a host-group operation
  blocks the host until every member's host reaches it;
- a communicator is created at its first operation (torch creates NCCL communicators lazily, and
  ``ncclCommInitRank`` blocks until every member joins): a rank's first operation on a stream blocks its host until
  every member of that communicator (the group, or the pair) has issued its first operation there too.

The state persists between checks (the trainer checks after every step, and the check itself is a host-group
collective): operations still in flight carry over. A rank whose host cannot reach the end of its window means the
job deadlocks on GPUs; :meth:`StreamReplay.feed` raises ``CommError`` naming the cycle (ranks, streams and the
operations that wait on each other).
"""

from __future__ import annotations

from collections import deque

from kuangchao_core.errors import CommError

#: a part of an operation: [kind, peer or None, what, tag]; kind is "send"/"recv" or a collective's name
Part = list


class _Op:
    __slots__ = ("rank", "oid", "stream", "group", "parts", "frontier", "started", "done", "keys", "matched")

    def __init__(self, rank: int, oid: int, stream: str, group: str, parts: list, frontier: int) -> None:
        self.rank, self.oid, self.stream, self.group, self.parts = rank, oid, stream, group, parts
        self.frontier = frontier  # waits the compute stream must pass before this op can start
        self.started = self.done = False
        self.keys: list[tuple] = []  # per part: the key its partner is registered under
        self.matched = [False] * len(parts)

    def describe(self) -> str:
        words = []
        for kind, peer, what, tag in self.parts:
            tagged = f", tag {tag}" if tag else ""
            if kind == "send":
                words.append(f"send to rank {peer} ({what}{tagged})")
            elif kind == "recv":
                words.append(f"recv from rank {peer} ({what}{tagged})")
            else:
                words.append(f"{kind} ({what})")
        body = words[0] if len(words) == 1 else "batch [" + ", ".join(words) + "]"
        return f"rank {self.rank}: {body} on stream {self.stream!r}"


class StreamReplay:
    """The NCCL stream model of one job, fed window by window with every rank's trace.

    ``members``: group name -> its global ranks (device and host groups). Call :meth:`feed` with the traces of a
    window (rank -> events, see :mod:`kuangchao_core.comm.stream_trace`); it raises ``CommError`` on a deadlock.
    """

    def __init__(self) -> None:
        self.members: dict[str, list[int]] = {}
        self.pending: dict[int, deque] = {}  # rank -> host events not yet passed
        self.streams: dict[int, dict[str, deque]] = {}  # rank -> stream -> ops in issue order
        self.waits: dict[int, list[int]] = {}  # rank -> ops the compute stream waits for, in order
        self.cpos: dict[int, int] = {}  # rank -> waits the compute stream has passed
        self.ops: dict[tuple[int, int], _Op] = {}  # (rank, oid) -> op not yet done
        self.done: set[tuple[int, int]] = set()
        self.counts: dict[tuple, int] = {}  # (rank, counter key) -> ops issued so far
        self.index: dict[tuple, dict] = {}  # match key -> {rank or side: (op, part)}
        self.host_arrived: dict[tuple, set[int]] = {}
        self.created: set[tuple[int, str]] = set()  # (rank, stream) whose communicator this rank has joined
        self.replayed = {"collective": 0, "p2p": 0, "grouped": 0, "host": 0}  # operations replayed, by kind

    # ------------------------------------------------------------------ feeding
    def feed(self, traces: dict[int, list], members: dict[str, list[int]], final: bool = False) -> None:
        """Append each rank's events of one window, run the model, and raise ``CommError`` when some rank's host
        cannot get through its window (a deadlock on GPUs) or, with ``final`` (the job's last check), when an
        operation can never complete."""
        self.members.update({k: list(v) for k, v in members.items()})
        for rank, events in traces.items():
            self._rank(rank)
            self.pending[rank].extend(events)
        self._run()
        blocked = [r for r in sorted(self.pending) if self.pending[r]]
        if blocked:
            raise CommError("NCCL would deadlock here: " + self._cycle(blocked))
        if final and self.ops:
            stuck = sorted(self.ops.values(), key=lambda o: (o.rank, o.oid))
            raise CommError(
                f"{len(stuck)} device-group operations would never complete on NCCL (nobody waits for them and "
                "their partners never come): " + "; ".join(o.describe() for o in stuck[:6])
            )

    def in_flight(self) -> int:
        """Operations issued and not yet complete (they carry over to the next window)."""
        return len(self.ops)

    def _rank(self, rank: int) -> None:
        if rank not in self.pending:
            self.pending[rank] = deque()
            self.streams[rank] = {}
            self.waits[rank] = []
            self.cpos[rank] = 0

    # ------------------------------------------------------------------ the model
    def _run(self) -> None:
        progress = True
        while progress:
            progress = False
            for r in sorted(self.pending):
                progress |= self._host(r)
            for r in sorted(self.pending):
                progress |= self._start(r)
            progress |= self._complete()

    def _host(self, r: int) -> bool:
        moved = False
        q = self.pending[r]
        while q:
            ev = q[0]
            kind = ev[0]
            if kind == "op":
                if (r, ev[2]) not in self.created:
                    key, members = self._creation(r, ev)
                    self.host_arrived.setdefault(key, set()).add(r)
                    if not members <= self.host_arrived[key]:
                        break
                    self.created.add((r, ev[2]))
                self._issue(r, ev)
            elif kind == "wait":
                self.waits[r].append(int(ev[1]))
            elif kind == "sync":
                if not self._compute_passed(r, len(self.waits[r])):
                    break
            elif kind == "host":
                if len(ev) == 4:
                    self.replayed["host"] += 1
                key, members = self._host_key(r, ev)
                arrived = self.host_arrived.setdefault(key, set())
                arrived.add(r)
                if not members <= arrived:
                    break
            else:
                raise CommError(f"stream trace of rank {r}: unknown event {ev!r}")
            q.popleft()
            moved = True
        return moved

    def _host_key(self, r: int, ev: list) -> tuple[tuple, set[int]]:
        """The rendezvous key of a host-group op and who meets there (numbered once, on first sight)."""
        if len(ev) == 4:
            _, group, op, peer = ev
            if peer is None:
                n = self._count(r, ("host", group, "coll"))
                ev += [("host", group, n), sorted(self.members.get(group, [r]))]
            else:
                src, dst = (r, int(peer)) if op == "send" else (int(peer), r)
                n = self._count(r, ("host", group, op, int(peer)))
                ev += [("host", group, src, dst, n), [src, dst]]
        return ev[4], set(ev[5])

    def _creation(self, r: int, ev: list) -> tuple[tuple, set[int]]:
        """The rendezvous of creating the communicator of ``ev``'s stream, and its members."""
        _, _, stream, group, parts = ev[:5]
        if stream == group:
            return ("create", stream), set(self.members.get(group, [r]))
        return ("create", stream), {r, int(parts[0][1])}

    def _count(self, r: int, key: tuple) -> int:
        n = self.counts.get((r, key), 0)
        self.counts[(r, key)] = n + 1
        return n

    def _issue(self, r: int, ev: list) -> None:
        _, oid, stream, group, parts = ev[:5]
        op = _Op(r, int(oid), stream, group, [list(p) for p in parts], len(self.waits[r]))
        kind = "collective" if op.parts[0][1] is None else ("grouped" if stream == group else "p2p")
        self.replayed[kind] += 1
        comm = stream  # the communicator: the group's own for collectives and batches, the pair's for single p2p
        for kind, peer, _what, _tag in op.parts:
            if peer is None:
                n = self._count(r, ("coll", group))
                key = ("coll", group, n)
                self.index.setdefault(key, {})[r] = (op, 0)
            else:
                peer = int(peer)
                src, dst = (r, peer) if kind == "send" else (peer, r)
                n = self._count(r, ("p2p", comm, kind, peer))
                key = ("p2p", comm, src, dst, n)
                self.index.setdefault(key, {})[kind] = (op, len(op.keys))
            op.keys.append(key)
        self.streams[r].setdefault(stream, deque()).append(op)
        self.ops[(r, op.oid)] = op

    def _compute_passed(self, r: int, upto: int) -> bool:
        waits, pos = self.waits[r], self.cpos[r]
        while pos < len(waits) and (r, waits[pos]) in self.done:
            pos += 1
        self.cpos[r] = pos
        return pos >= upto

    def _start(self, r: int) -> bool:
        moved = False
        for q in self.streams[r].values():
            if q and not q[0].started and self._compute_passed(r, q[0].frontier):
                q[0].started = True
                moved = True
        return moved

    def _complete(self) -> bool:
        finished = []
        for op in list(self.ops.values()):
            if not op.started or op.done:
                continue
            for i, key in enumerate(op.keys):
                if op.matched[i]:
                    continue
                entries = self.index.get(key, {})
                if key[0] == "coll":
                    members = self.members.get(op.group, [])
                    if len(entries) == len(members) and all(o.started for o, _ in entries.values()):
                        for o, j in entries.values():
                            o.matched[j] = True
                        self.index.pop(key, None)
                else:
                    if len(entries) == 2 and all(o.started for o, _ in entries.values()):
                        for o, j in entries.values():
                            o.matched[j] = True
                        self.index.pop(key, None)
            if all(op.matched):
                finished.append(op)
        for op in finished:
            op.done = True
            self.streams[op.rank][op.stream].popleft()
            del self.ops[(op.rank, op.oid)]
            self.done.add((op.rank, op.oid))
        return bool(finished)

    # ------------------------------------------------------------------ naming the cycle
    def _head_wait(self, r: int):
        waits, pos = self.waits[r], self.cpos[r]
        return self.ops.get((r, waits[pos])) if pos < len(waits) else None

    def _edges(self, node) -> list[tuple[str, object]]:
        """What ``node`` waits for, as (why, node) pairs; a node is ("host", rank) or an ``_Op`` not done."""
        if isinstance(node, tuple):
            return self._host_edges(node[1])
        op = node
        if not op.started:
            head = self.streams[op.rank][op.stream][0]
            if head is not op:
                return [("is queued behind", head)]
            wait = self._head_wait(op.rank)
            return [("waits for the compute stream, which waits for", wait)] if wait is not None else []
        out: list[tuple[str, object]] = []
        for i, key in enumerate(op.keys):
            if op.matched[i]:
                continue
            entries = self.index.get(key, {})
            if key[0] == "coll":
                for m in self.members.get(op.group, []):
                    if m not in entries:
                        out.append(("waits for the same collective, not issued yet by", ("host", m)))
                    elif not entries[m][0].started:
                        out.append(("waits for the same collective on", entries[m][0]))
            else:
                side = "recv" if op.parts[i][0] == "send" else "send"
                if side not in entries:
                    out.append(("waits for its partner, not issued yet by", ("host", int(op.parts[i][1]))))
                elif not entries[side][0].started:
                    out.append(("waits for its partner", entries[side][0]))
        return out

    def _host_edges(self, r: int) -> list[tuple[str, object]]:
        if not self.pending[r]:  # done with the window: the check after it is a host-group collective
            why = "has finished its step and waits at the host group for"
            return [(why, ("host", m)) for m in sorted(self.pending) if self.pending[m]]
        ev = self.pending[r][0]
        if ev[0] == "sync":
            wait = self._head_wait(r)
            why = "reads a device value, so it waits for the compute stream, which waits for"
            return [(why, wait)] if wait is not None else []
        if ev[0] == "host":
            key, members = self._host_key(r, ev)
            why = f"is in {ev[2]} on host group {ev[1]!r} and waits for"
            return [(why, ("host", m)) for m in sorted(members - self.host_arrived.get(key, set()))]
        if ev[0] == "op":
            key, members = self._creation(r, ev)
            why = f"creates the communicator of stream {ev[2]!r} (its first operation there) and waits for"
            return [(why, ("host", m)) for m in sorted(members - self.host_arrived.get(key, set()))]
        return []

    @staticmethod
    def _key(node) -> tuple:
        return node if isinstance(node, tuple) else ("op", node.rank, node.oid)

    def _cycle(self, blocked: list[int]) -> str:
        """Follow what each blocked node waits for until a node repeats: the cycle, in words."""
        node: object = ("host", blocked[0])
        seen: dict[tuple, int] = {}
        path: list[tuple[str, object]] = [("", node)]
        while self._key(node) not in seen:
            seen[self._key(node)] = len(path) - 1
            edges = self._edges(node)
            if not edges:
                return f"ranks {blocked} cannot finish their steps ({self._name(node)} waits on nothing known)"
            why, node = edges[0]
            path.append((why, node))
        loop = path[seen[self._key(node)] :]
        steps = [f"{self._name(a)} {why} {self._name(b)}" for (_, a), (why, b) in zip(loop, loop[1:], strict=False)]
        ranks = sorted({n[1] if isinstance(n, tuple) else n.rank for _, n in loop})
        return f"ranks {ranks} wait on each other in a cycle: " + "; ".join(steps)

    @staticmethod
    def _name(node) -> str:
        return f"rank {node[1]}'s host" if isinstance(node, tuple) else node.describe()

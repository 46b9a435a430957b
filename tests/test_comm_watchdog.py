"""The watchdog measures waiting on the stream (issue 41): real Gloo processes under ``KC_COMM_RULES=nccl``.

A pipeline stage posts its receives early, while its peer computes; on a GPU the host goes on and only the
watchdog sees the receive. Its age counts from when it reached the head of its stream (the pair's stream: the
receive queued before it has completed), and when it is late the watchdog asks the peer, which answers that it is
working (its progress beacon), so the receive is *waiting*, not hung. A peer that never sends stops making progress
and is still named: group, op, sequence number, the rank that did not arrive.

Controls (the watchdog's sabotage seams, set inside the workers): ``CLOCK = "issue"`` with ``JUDGE_PROGRESS =
False`` is the watchdog before the issue, which names the early receive hung and breaks the group; ``CLOCK =
"issue"`` alone shows the second receive, queued behind the first, judged late from its issue although it never
waited a notice period at the head of its stream.
"""

from __future__ import annotations

from tests.mp import run_distributed

RULES = {"KC_COMM_RULES": "nccl"}
TIMEOUT_S = 2.0  # the group's timeout: the watchdog looks at an op after 0.9 x this at the head of its stream
GROUP = "pp[0,1]"


def _setup(sabotage: str):
    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm import watchdog
    from kuangchao_core.comm.group import CommGroup, init_distributed
    from kuangchao_core.hal import device_init
    from kuangchao_core.perm import guard_api

    if sabotage == "issue_clock":  # the watchdog before issue 41: age from issue, every late op a hang
        watchdog.CLOCK, watchdog.JUDGE_PROGRESS = "issue", False
    elif sabotage == "no_head":  # age from issue, the progress verdict kept
        watchdog.CLOCK = "issue"
    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    init_distributed(backend="gloo", timeout_ms=60_000)
    group = CommGroup([0, 1], backend="gloo", timeout_ms=int(TIMEOUT_S * 1000), name=GROUP)
    P.all_reduce(torch.ones(2, device=dev), group=group)  # both ranks start the clock together
    return dev, group


def _compute(until: float) -> int:
    """A stage's own work until ``until`` (perf_counter), one beat per unit as the engine gives per action."""
    import time

    import torch

    from kuangchao_core.comm import diag

    a, n = torch.randn(64, 64), 0
    while time.perf_counter() < until:
        a = torch.tanh(a @ a)
        diag.beat()
        n += 1
        time.sleep(0.01)
    return n


def _early_receive(rank: int, world_size: int, sabotage: str) -> dict:
    import time

    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm import watchdog

    dev, group = _setup(sabotage)
    t0 = time.perf_counter()
    out: dict = {}
    if rank == 0:  # both receives posted at once; the first waits 1.5 T for its send, the second 0.3 T more
        a, b = torch.zeros(4, device=dev), torch.zeros(4, device=dev)
        ha = P.irecv(a, src=1, group=group)
        hb = P.irecv(b, src=1, group=group)  # queued behind the first on the pair's stream
        _compute(t0 + 1.25 * TIMEOUT_S)  # past the notice point; Gloo's own wait is then bounded by T again
        ha.wait()
        out["a_at"] = time.perf_counter() - t0
        hb.wait()
        out["b_at"] = time.perf_counter() - t0
        out["received"] = [a.tolist(), b.tolist()]
        time.sleep(3 * watchdog.POLL_S)  # the watchdog's next look: both complete, nothing more to judge
    else:  # the peer computes for longer than the timeout before each send
        out["beats"] = _compute(t0 + 1.5 * TIMEOUT_S)
        P.send(torch.full((4,), 1.0, device=dev), dst=0, group=group)
        out["beats"] += _compute(t0 + 1.8 * TIMEOUT_S)
        P.send(torch.full((4,), 2.0, device=dev), dst=0, group=group)
    out["noticed"] = [(e.group, e.op, e.seq, e.missing_ranks) for e in watchdog.noticed()]
    out["waited"] = watchdog.waited()
    out["broken"] = group.broken
    return out


def test_an_early_receive_behind_a_computing_peer_is_waiting_not_hung():
    got = run_distributed(_early_receive, 2, args=("",), init_pg=False, env=RULES, timeout=120)
    r0 = got[0]
    assert r0["received"] == [[1.0] * 4, [2.0] * 4]
    assert r0["a_at"] > TIMEOUT_S  # the first receive was in flight longer than the timeout (sent at 1.5 T)...
    assert r0["noticed"] == [] and r0["broken"] is None  # ...and never named hung: the group still works
    # it was late once and judged waiting for rank 1, which was computing (the beacon: a beat every few ms)
    assert (GROUP, "recv", 1, [1]) in r0["waited"], r0["waited"]
    # the second was in flight past the notice point too (sent at 1.8 T), but its clock started when the first
    # completed: it waited 0.3 T at the head of its stream and was never judged
    assert r0["b_at"] > 1.5 * TIMEOUT_S
    assert not [w for w in r0["waited"] if w[2] == 2], r0["waited"]
    assert got[1]["beats"] > 0 and got[1]["noticed"] == []


def test_the_issue_time_clock_names_the_early_receive_hung():
    got = run_distributed(_early_receive, 2, args=("issue_clock",), init_pg=False, env=RULES, timeout=120)
    assert got[0]["noticed"] == [(GROUP, "recv", 1, [1])]  # the bug: declared hung while its peer computed
    assert "recv seq 1 timed out" in got[0]["broken"]


def test_without_the_head_of_stream_rule_the_queued_receive_is_judged_from_its_issue():
    got = run_distributed(_early_receive, 2, args=("no_head",), init_pg=False, env=RULES, timeout=120)
    assert got[0]["noticed"] == [] and got[0]["broken"] is None  # the progress verdict alone keeps it alive
    assert [w for w in got[0]["waited"] if w[2] == 2], got[0]["waited"]  # but the queued one was aged early


def _never_sends(rank: int, world_size: int) -> dict:
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm import watchdog
    from kuangchao_core.errors import CommTimeout

    dev, group = _setup("")
    store = dist.distributed_c10d._get_default_store()
    t0 = time.perf_counter()
    out: dict = {}
    if rank == 0:
        handle = P.irecv(torch.zeros(4, device=dev), src=1, group=group)
        deadline = t0 + 4 * TIMEOUT_S + 2.0  # 0.9 T at the head, up to T more for rank 1's idle window, a probe
        while not watchdog.noticed() and time.perf_counter() < deadline:
            time.sleep(0.05)
        out["noticed"] = [(e.group, e.op, e.seq, e.missing_ranks) for e in watchdog.noticed()]
        out["noticed_after"] = time.perf_counter() - t0
        try:
            handle.wait()
            out["wait"] = "returned"
        except CommTimeout as exc:
            out["wait"] = (exc.group, exc.op, exc.seq, exc.missing_ranks)
        store.set("kc_test_never_done", "1")
    else:  # works a little, then stops for good without sending (alive: its responder answers)
        _compute(t0 + 0.3)
        store.wait(["kc_test_never_done"], timedelta(seconds=60))
    return out


def test_a_peer_that_never_sends_is_named():
    got = run_distributed(_never_sends, 2, init_pg=False, env=RULES, timeout=120)
    assert got[0]["noticed"] == [(GROUP, "recv", 1, [1])], got[0]
    assert got[0]["wait"] == (GROUP, "recv", 1, [1])  # the wait raises what the watchdog named

"""NCCL's stream model (``comm.stream_model``) on hand-written traces: each rule it models, with the order that breaks
it and the one that does not (the whole jobs it replays are ``test_nccl_rules_job.py``)."""

from __future__ import annotations

import pytest

from kuangchao_core.comm.stream_model import StreamReplay
from kuangchao_core.errors import CommError

PP = "pp[0,1]"


def _single(oid: int, kind: str, peer: int, tag: int) -> list:
    return ["op", oid, f"{PP}:0-1", PP, [[kind, peer, "float32 [2, 8]", tag]]]


def _batch(oid: int, *parts: tuple[str, int, int]) -> list:
    return ["op", oid, PP, PP, [[kind, peer, "float32 [2, 8]", tag] for kind, peer, tag in parts]]


def _replay(traces: dict[int, list], members: dict[str, list[int]] | None = None, final: bool = True) -> StreamReplay:
    replay = StreamReplay()
    replay.feed(traces, members or {PP: [0, 1]}, final=final)
    return replay


def test_receives_posted_ahead_of_sends_on_one_pair_stream_deadlock_and_grouped_exchanges_do_not():
    # 1F1B at p = 2, m = 2 as the executor issued it before: rank 0 sends act0, posts grad0's receive, sends act1;
    # rank 1 posts the receives of act0 and act1 before it sends grad0 (tags: act0 1, grad0 2, act1 3, grad1 4)
    r0 = [_single(1, "send", 1, 1), _single(2, "recv", 1, 2), ["wait", 2], _single(3, "send", 1, 3)]
    r0 += [_single(4, "recv", 1, 4), ["wait", 4], ["wait", 1], ["wait", 3], ["sync"]]
    r1 = [_single(1, "recv", 0, 1), _single(2, "recv", 0, 3), ["wait", 1], _single(3, "send", 0, 2), ["wait", 2]]
    r1 += [_single(4, "send", 0, 4), ["wait", 3], ["wait", 4], ["sync"]]
    with pytest.raises(CommError) as info:
        _replay({0: r0, 1: r1})
    text = str(info.value)
    assert "rank 0: recv from rank 1 (float32 [2, 8], tag 2)" in text and "rank 1: recv from rank 0" in text, text
    assert "is queued behind" in text and "ranks [0, 1]" in text, text
    # the same traffic grouped per exchange, in one order on both ranks
    g0 = [_batch(1, ("send", 1, 1)), _batch(2, ("send", 1, 3), ("recv", 1, 2)), ["wait", 2], _batch(3, ("recv", 1, 4))]
    g1 = [_batch(1, ("recv", 0, 1)), ["wait", 1], _batch(2, ("send", 0, 2), ("recv", 0, 3)), ["wait", 2]]
    g1 += [_batch(3, ("send", 0, 4))]
    replay = _replay({0: [*g0, ["wait", 3], ["wait", 1], ["sync"]], 1: [*g1, ["wait", 3], ["sync"]]})
    assert replay.replayed["grouped"] == 6 and replay.in_flight() == 0


def test_a_collective_waits_for_every_member_and_a_host_read_for_the_compute_stream():
    def ar(oid: int) -> list:
        return ["op", oid, "dp", "dp", [["all_reduce", None, "float32 [4]", 0]]]

    replay = _replay({0: [ar(1), ["wait", 1], ["sync"]], 1: [ar(1), ["wait", 1], ["sync"]]}, {"dp": [0, 1]})
    assert replay.replayed["collective"] == 2
    with pytest.raises(CommError, match="waits for the same collective, not issued yet by rank 1's host"):
        replay.feed({0: [ar(2), ["wait", 2], ["sync"]], 1: []}, {"dp": [0, 1]})  # rank 0 reads, rank 1 never came


def test_an_operation_in_flight_carries_over_to_the_next_window_but_not_past_the_end():
    def created() -> StreamReplay:  # the pair's communicator made by one exchange
        return _replay({0: [_single(1, "send", 1, 0), ["wait", 1]], 1: [_single(1, "recv", 0, 0), ["wait", 1]]})

    replay = created()
    replay.feed({0: [_single(2, "send", 1, 0)], 1: []}, {PP: [0, 1]})  # nobody waits for it yet: not a deadlock
    assert replay.in_flight() == 1
    replay.feed({0: [["wait", 2], ["sync"]], 1: [_single(2, "recv", 0, 0), ["wait", 2]]}, {PP: [0, 1]})
    assert replay.in_flight() == 0
    lonely = created()
    lonely.feed({0: [_single(2, "send", 1, 0)], 1: []}, {PP: [0, 1]})
    with pytest.raises(CommError, match="would never complete"):  # the run's last check
        lonely.feed({0: [], 1: []}, {PP: [0, 1]}, final=True)


def test_a_communicator_is_created_by_every_member_at_its_first_operation():
    group = ["op", 1, "a", "a", [["send", 1, "float32 [2]", 0]]]
    peer = ["op", 1, "a", "a", [["recv", 0, "float32 [2]", 0]]]
    with pytest.raises(CommError, match="rank 0's host creates the communicator of stream 'a'.*waits for rank 2"):
        _replay({0: [group, ["wait", 1], ["sync"]], 1: [peer, ["wait", 1], ["sync"]], 2: []}, {"a": [0, 1, 2]})
    # control: a group of the two ranks that use it
    assert _replay({0: [group, ["wait", 1], ["sync"]], 1: [peer, ["wait", 1], ["sync"]]}, {"a": [0, 1]})

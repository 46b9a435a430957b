"""L2 communication on 4 real Gloo processes: primitives, groups, async, timeouts, timers, guard, state dump."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import typer

from kuangchao_core.comm.state import check_consistency
from tests.mp import run_distributed

WORLD = 4


def _primitives_body(rank, world_size, dump_dir):
    import kuangchao.distributed as kc
    from kuangchao_core.errors import PermissionDenied
    from kuangchao_core.perm import guard_api

    out = {}
    # default guard: no token, so even the first collective is refused
    try:
        kc.all_reduce(tensor=torch.ones(1))
        out["denied"] = None
    except PermissionDenied as exc:
        out["denied"] = (exc.interface, exc.resource)
    guard_api.install_guard(guard_api.AllowAll())
    kc.init()
    kc.COMM_STATS.reset()

    g = kc.CommGroup(ranks=[0, 1, 2, 3], backend="gloo", timeout_ms=30000)
    sub_a = kc.CommGroup(ranks=[2, 0], backend="gloo", timeout_ms=30000, name="pair_a")  # caller's order kept
    sub_b = kc.CommGroup(ranks=[1, 3], backend="auto", timeout_ms=30000)

    base = torch.tensor([rank + 1.0, 10.0 * (rank + 1), -float(rank)])
    for op in ("sum", "avg", "max", "min", "prod"):
        t = base.clone()
        kc.all_reduce(tensor=t, group=g, op=op)
        out[f"ar_{op}"] = t.tolist()
    t = torch.tensor([rank + 1, 7], dtype=torch.int64)
    kc.all_reduce(tensor=t, group=g, op="avg")
    out["ar_avg_int"] = t.tolist()

    t = torch.full((3,), float(rank))
    kc.broadcast(tensor=t, src=2, group=g)
    out["bcast"] = t.tolist()

    gathered = kc.all_gather(None, torch.tensor([rank, rank * rank]), group=g)
    out["gather"] = [x.tolist() for x in gathered]

    inputs = [torch.tensor([100.0 * rank + i, float(i)]) for i in range(world_size)]
    rs = torch.empty(2)
    kc.reduce_scatter(rs, inputs, group=g, op="sum")
    out["rs_sum"] = rs.tolist()
    rs2 = torch.empty(2)
    kc.reduce_scatter(rs2, torch.cat(inputs), group=g, op="avg")
    out["rs_avg"] = rs2.tolist()

    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(2)
    payload = torch.tensor([float(rank), 3.0 * rank])
    if rank % 2 == 0:
        kc.send(payload, dst=nxt, group=g)
        kc.recv(got, src=prv, group=g)
    else:
        kc.recv(got, src=prv, group=g)
        kc.send(payload, dst=nxt, group=g)
    out["recv"] = got.tolist()

    if rank in sub_a.ranks:
        t = torch.tensor([float(rank + 1)])
        kc.all_reduce(t, group=sub_a)
        out["sub_a_sum"] = t.item()
        out["sub_a_gather"] = [x.item() for x in kc.all_gather(None, torch.tensor([float(rank)]), group=sub_a)]
        rs = torch.empty(1)
        kc.reduce_scatter(rs, [torch.tensor([10.0 * rank]), torch.tensor([float(rank)])], group=sub_a)
        out["sub_a_rs"] = rs.item()
    if rank in sub_b.ranks:
        t = torch.tensor([float(rank + 1)])
        kc.all_reduce(t, group=sub_b, op="max")
        out["sub_b_max"] = t.item()
        try:
            kc.all_reduce(torch.ones(1), group=sub_a)
        except kc.CommError as exc:
            out["non_member_error"] = str(exc)
    out["sub_rank"] = (sub_a.rank, sub_b.rank)

    t = torch.full((1000,), float(rank))
    handle = kc.all_reduce(tensor=t, group=g, op="avg", async_op=True)
    handle.wait()
    out["async_avg"] = t[:2].tolist()

    out["stats_seconds"] = kc.COMM_STATS.seconds_by_op()
    out["stats_counts"] = kc.COMM_STATS.counts_by_op()
    out["stats_bytes"] = kc.COMM_STATS.bytes_by_op()
    out["stats_total"] = kc.COMM_STATS.total_seconds()
    out["dump"] = kc.dump_groups()
    from kuangchao_core.comm.state import write_dump

    write_dump(f"{dump_dir}/rank{rank}.json")
    return out


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("comm_dumps")


@pytest.fixture(scope="module")
def prim(dump_dir):
    return run_distributed(_primitives_body, WORLD, args=(str(dump_dir),), timeout=120)


def _base(r):
    return [r + 1.0, 10.0 * (r + 1), -float(r)]


def test_permission_denied_without_guard(prim):
    for r in prim:
        assert r["denied"] == ("all_reduce", "group:world")


def test_all_reduce_ops_match_arithmetic(prim):
    cols = list(zip(*[_base(r) for r in range(WORLD)], strict=True))
    expect = {
        "sum": [sum(c) for c in cols],
        "avg": [sum(c) / WORLD for c in cols],
        "max": [max(c) for c in cols],
        "min": [min(c) for c in cols],
        "prod": [float(torch.tensor(c).prod()) for c in cols],
    }
    for r in prim:
        for op, want in expect.items():
            assert r[f"ar_{op}"] == pytest.approx(want), op
        assert r["ar_avg_int"] == [sum(range(1, WORLD + 1)) // WORLD, 7]


def test_broadcast_all_gather_reduce_scatter_send_recv(prim):
    for rank, r in enumerate(prim):
        assert r["bcast"] == [2.0, 2.0, 2.0]
        assert r["gather"] == [[q, q * q] for q in range(WORLD)]
        assert r["rs_sum"] == pytest.approx([sum(100.0 * q + rank for q in range(WORLD)), WORLD * float(rank)])
        assert r["rs_avg"] == pytest.approx([sum(100.0 * q + rank for q in range(WORLD)) / WORLD, float(rank)])
        prv = (rank - 1) % WORLD
        assert r["recv"] == [float(prv), 3.0 * prv]


def test_subgroups_keep_caller_rank_order(prim):
    for rank in (0, 2):
        assert prim[rank]["sub_a_sum"] == 4.0
        assert prim[rank]["sub_a_gather"] == [2.0, 0.0]  # ranks=[2, 0]: rank 2's tensor first
    # member i of [2, 0] gets chunk i: rank 2 -> sum of chunk 0 = 10*2 + 10*0, rank 0 -> 2 + 0
    assert prim[2]["sub_a_rs"] == 20.0
    assert prim[0]["sub_a_rs"] == 2.0
    assert prim[1]["sub_b_max"] == prim[3]["sub_b_max"] == 4.0
    assert "not a member" in prim[1]["non_member_error"]
    assert [r["sub_rank"] for r in prim] == [(1, None), (None, 0), (0, None), (None, 1)]


def test_async_all_reduce(prim):
    for r in prim:
        assert r["async_avg"] == [1.5, 1.5]


def test_comm_stats_per_op_kind(prim):
    for r in prim:
        secs, counts = r["stats_seconds"], r["stats_counts"]
        assert set(secs) == {"broadcast", "all_reduce", "all_gather", "reduce_scatter", "send", "recv"}
        assert all(v > 0 for v in secs.values())
        assert r["stats_total"] == pytest.approx(sum(secs.values()))
        assert counts["send"] == counts["recv"] == 1 and counts["broadcast"] == 1
        assert r["stats_bytes"]["broadcast"] == 3 * 4
    # all_reduce: 6 on g + async one, plus subgroup ops on members
    assert prim[0]["stats_counts"]["all_reduce"] == 8
    assert prim[1]["stats_counts"]["all_reduce"] == 8


def test_state_dump_consistent_and_detects_disorder(prim):
    dumps = {rank: r["dump"] for rank, r in enumerate(prim)}
    assert check_consistency(dumps) == []
    names = [d["name"] for d in dumps[0]]
    assert names[0] == "world" and "pair_a" in names
    pair = next(d for d in dumps[0] if d["name"] == "pair_a")
    assert pair["ranks"] == [2, 0] and pair["backend"] == "gloo" and pair["last_seq"] == 3

    tampered = {rank: [dict(d) for d in ds] for rank, ds in dumps.items()}
    entry = next(d for d in tampered[2] if d["name"] == "pair_a")
    entry["ranks"] = [0, 2]
    entry["backend"] = "nccl"
    entry["last_seq"] = 2
    problems = check_consistency(tampered)
    text = "\n".join(problems)
    assert "inconsistent rank order" in text and "mixed backends" in text
    assert "ranks [2] are behind" in text


def _timeout_body(rank, world_size):
    import kuangchao.distributed as kc
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    g = kc.CommGroup(ranks=list(range(world_size)), backend="gloo", timeout_ms=1500, name="tmo")
    pair = kc.CommGroup(ranks=[0, 1], backend="gloo", timeout_ms=1000, name="p2p")
    kc.all_reduce(torch.ones(2), group=g)  # seq 1 completes everywhere
    out = {}
    if rank != 3:  # rank 3 never calls the second collective
        t0 = time.monotonic()
        try:
            kc.all_reduce(torch.ones(2), group=g)
        except kc.CommTimeout as exc:
            out["coll"] = (exc.group, exc.op, exc.seq, exc.missing_ranks, exc.timeout_ms, time.monotonic() - t0)
    if rank == 0:  # rank 1 never sends
        t0 = time.monotonic()
        try:
            kc.recv(torch.empty(1), src=1, group=pair)
        except kc.CommTimeout as exc:
            out["p2p"] = (exc.group, exc.op, exc.seq, exc.missing_ranks, time.monotonic() - t0)
    dist.barrier()
    return out


def test_timeout_names_missing_rank():
    res = run_distributed(_timeout_body, WORLD, timeout=90)
    for rank in range(3):
        group, op, seq, missing, timeout_ms, elapsed = res[rank]["coll"]
        assert (group, op, seq, missing, timeout_ms) == ("tmo", "all_reduce", 2, [3], 1500)
        assert elapsed < 1.5 + 2.5  # the timeout plus a short diagnosis, never a hang
    assert "coll" not in res[3]
    group, op, seq, missing, elapsed = res[0]["p2p"]
    assert (group, op, seq, missing) == ("p2p", "recv", 1, [1])
    assert elapsed < 1.0 + 2.5


def test_kc_debug_comm_reads_dumps(prim, dump_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from kuangchao.cli import debug

    app = typer.Typer()
    app.command("noop")(lambda: None)  # a second command keeps "debug" a sub-command
    debug.register(app)

    runner = CliRunner()
    ok = runner.invoke(app, ["debug", "comm", str(dump_dir)])
    assert ok.exit_code == 0, ok.output
    assert "consistent" in ok.output and "pair_a" in ok.output

    for f in dump_dir.glob("*.json"):
        data = json.loads(f.read_text())
        if data["rank"] == 3:
            for g in data["groups"]:
                if g["name"] == "world":
                    g["ranks"] = [3, 2, 1, 0]
        (tmp_path / f.name).write_text(json.dumps(data))
    bad = runner.invoke(app, ["debug", "comm", str(tmp_path)])
    assert bad.exit_code == 1
    assert "inconsistent rank order" in bad.output and "'world'" in bad.output
    assert runner.invoke(app, ["debug", "comm", str(tmp_path / "nope.json")]).exit_code == 2


def _init_from_env_body(rank, world_size):
    import kuangchao.distributed as kc
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    world = kc.init(backend="auto", timeout_ms=60000)
    same = kc.CommGroup(ranks=[1, 0], timeout_ms=60000)
    other = kc.CommGroup(ranks=[0, 1], timeout_ms=5000)
    t = torch.tensor([float(rank + 1)])
    kc.all_reduce(t, group=same)
    out = (world.backend, world.timeout_ms, same.pg is world.pg, other.pg is world.pg, t.item())
    dist.destroy_process_group()
    return out


def test_init_from_torchrun_env_and_world_group_reuse():
    res = run_distributed(_init_from_env_body, 2, init_pg=False, timeout=90)
    assert res == [("gloo", 60000, True, False, 3.0)] * 2

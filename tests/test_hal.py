"""L1 hardware abstraction: cached device context, guarded interfaces, pool reuse and allocation records."""

from __future__ import annotations

import gc
import socket

import pytest
import torch
import typer

from kuangchao_core import hal
from kuangchao_core.errors import KuangchaoError, PermissionDenied
from kuangchao_core.hal import context as hal_context
from kuangchao_core.perm import guard_api


class _Recording:
    """Allows everything and remembers what was asked."""

    def __init__(self):
        self.calls = []

    def check(self, interface, resource):
        self.calls.append((interface, resource))


@pytest.fixture()
def guard():
    g = _Recording()
    previous = guard_api.install_guard(g)
    hal_context._clear_cache_for_tests()
    hal.POOL.release_unused()
    yield g
    guard_api.install_guard(previous)
    hal_context._clear_cache_for_tests()


def test_device_context_built_once_and_cached(guard):
    ctx = hal.device_init("cpu")
    assert ctx.kind == "cpu" and ctx.device == torch.device("cpu")
    assert ctx.hostname == socket.gethostname()
    assert ctx.total_memory > 0 and ctx.name
    assert hal.device_init("cpu") is ctx
    assert hal.current_context() is ctx
    assert guard.calls == [("device_init", "device:cpu")] * 2  # checked on every call
    assert ctx.to_dict()["device"] == "cpu"


def test_auto_picks_cpu_without_accelerator(guard):
    ctx = hal.device_init("auto")
    assert ctx.kind == ("cpu" if not torch.cuda.is_available() else ctx.kind)
    if not torch.cuda.is_available():
        with pytest.raises(KuangchaoError, match="not available"):
            hal.device_init("cuda")


def test_default_guard_denies_every_interface():
    previous = guard_api.install_guard(guard_api.DenyAll())
    try:
        with pytest.raises(PermissionDenied, match="device_init on device:cpu"):
            hal.device_init("cpu")
        with pytest.raises(PermissionDenied, match="memory_alloc on memory:activations"):
            hal.memory_alloc((2, 2), region="activations", module="m")
        with pytest.raises(PermissionDenied, match="stream_create"):
            hal.stream_create()
    finally:
        guard_api.install_guard(previous)


def test_alloc_free_records_and_pool_reuse(guard):
    hal.device_init("cpu")
    a = hal.memory_alloc((4, 8), torch.float32, region="weights", module="model")
    b = hal.memory_alloc(64, region="buffers", module="data")
    assert a.shape == (4, 8) and b.dtype == torch.uint8 and b.numel() == 64
    rep = hal.memory_report()
    assert rep["modules"]["model"]["live_bytes"] == 128
    assert rep["modules"]["data"]["live_bytes"] == 64
    assert rep["regions"] == {"weights": 128, "buffers": 64}

    ptr = a.data_ptr()
    hal.memory_free(a)
    assert ("memory_free", "memory:weights") in guard.calls
    assert hal.POOL.cached_bytes == 128
    c = hal.memory_alloc((32,), torch.float32, region="weights", module="optimizer")
    assert c.data_ptr() == ptr  # the freed block was reused
    rep = hal.memory_report()
    assert rep["modules"]["model"] == {**rep["modules"]["model"], "live_bytes": 0, "frees": 1, "peak_bytes": 128}
    assert rep["modules"]["optimizer"]["reused"] == 1
    assert hal.POOL.cached_bytes == 0

    with pytest.raises(KuangchaoError, match="not allocated by memory_alloc"):
        hal.memory_free(torch.empty(3))
    hal.memory_free(c)
    with pytest.raises(KuangchaoError, match="already freed"):
        hal.memory_free(c)


def test_dropped_tensor_leaves_records_and_release_unused(guard):
    t = hal.memory_alloc((1000,), module="leaky")
    assert hal.memory_report()["modules"]["leaky"]["live_bytes"] == 4000
    del t
    gc.collect()
    assert hal.memory_report()["modules"]["leaky"]["live_bytes"] == 0
    u = hal.memory_alloc((256,), module="m")
    hal.memory_free(u)
    assert hal.release_unused() == 1024
    assert hal.POOL.cached_bytes == 0


def test_pool_capacity_is_respected(guard):
    pool = hal.MemoryPool(max_cached_bytes=100)
    t = pool.alloc(64, (64,), torch.float32, torch.device("cpu"), "r", "m")  # 256 bytes > capacity
    pool.free(t)
    assert pool.cached_bytes == 0


def test_pool_cap_drops_the_cache_then_raises_one_line_naming_the_top_consumers(guard, tmp_path):
    from kuangchao_core.hal import memory as hal_memory

    pool = hal.MemoryPool(limit_bytes=1000)
    kept = pool.alloc(100, (100,), torch.float32, torch.device("cpu"), "params", "big")  # 400 B live
    spare = pool.alloc(50, (50,), torch.float32, torch.device("cpu"), "grads", "small")
    pool.free(spare)  # 200 B cached
    again = pool.alloc(100, (100,), torch.uint8, torch.device("cpu"), "comm", "fits")  # 400+200+100: fits
    assert pool.cached_bytes == 200
    more = pool.alloc(400, (400,), torch.uint8, torch.device("cpu"), "comm", "room")  # fits once the cache goes
    assert pool.cached_bytes == 0 and pool.live_bytes == 900
    previous = hal_memory.POOL
    hal_memory.POOL = pool  # the records an out-of-memory names are the module pool's
    hal_memory.set_oom_dump(tmp_path / "rank_00000.json")
    try:
        with pytest.raises(hal_memory.HalOutOfMemory) as err:
            pool.alloc(101, (101,), torch.uint8, torch.device("cpu"), "comm", "late")
    finally:
        hal_memory.POOL = previous
        hal_memory.set_oom_dump(None)
    message = str(err.value)
    assert "\n" not in message and message.startswith("out of memory: late (comm) asked the HAL pool for 101 B")
    assert message.endswith("top consumers: big params 400 B, room comm 400 B, fits comm 100 B"), message
    assert (tmp_path / "rank_00000.json").is_file() and isinstance(err.value, MemoryError)
    assert pool.live_bytes == 900 and kept.numel() == 100 and again.numel() == 100 and more.numel() == 400


def test_bad_byte_count_is_refused(guard):
    with pytest.raises(KuangchaoError, match="multiple"):
        hal.memory_alloc(10, torch.float32)


def test_cpu_stream_is_noop_with_same_interface(guard):
    s = hal.stream_create()
    assert guard.calls[-1] == ("stream_create", "device:cpu")
    with s:
        x = torch.ones(3) * 2
    s.wait_stream(hal.stream_create())
    s.synchronize()
    assert s.query() is True and x.sum().item() == 6.0


def test_sdk_memory_namespace(guard):
    import kuangchao.distributed as kc

    t = kc.memory.alloc((8,), module="sdk")
    kc.memory.free(t)
    assert kc.memory.release_unused() == 32


def test_kc_debug_memory_shows_modules(guard, tmp_path):
    from typer.testing import CliRunner

    from kuangchao.cli import debug

    app = typer.Typer()
    app.command("noop")(lambda: None)  # a second command keeps "debug" a sub-command
    debug.register(app)

    keep = hal.memory_alloc((256,), region="weights", module="embedding")
    path = hal.write_memory_report(tmp_path / "mem.json")
    res = CliRunner().invoke(app, ["debug", "memory", str(path)])
    assert res.exit_code == 0, res.output
    assert "embedding" in res.output and "1,024" in res.output
    hal.memory_free(keep)

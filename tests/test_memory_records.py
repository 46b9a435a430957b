"""Memory the user can read after an out-of-memory (issue 44 item 3): per-module records on every rank, the engine's
buffers from the HAL pool, one message naming the top consumers.

- On a real dp2 Gloo job with ZeRO-0 (DP gradient buckets from the pool), and with ZeRO-2 over a group of one
  (flat shards and bucket buffers from the pool; one rank, because Gloo's reduce-scatter and all-gather stage copies
  inside torch that its worker thread may free, and frees on a thread the profiler does not follow go unseen: the
  measurement then counts up to a bucket and a chunk per op still held, at random), each rank's records (``engine/memory_ledger.py``), taken mid-step — after one optimizer step, with the next
  step's forward done and its activations held — sum to within 5 % of the rank's *measured* bytes: every CPU
  allocator allocation and free since before the model was built, as ``torch.profiler`` (``profile_memory``)
  recorded them, summed — the bytes the allocator hands out and has not taken back, counted by the allocator's
  own events, not by walking the tensors the records walk. Negative control: the same records without the
  optimizer's state miss by more than 5 %.
- A pool cap (``hal.memory_pool_size``) below the step's need ends the ZeRO-2 step with one HalOutOfMemory whose one
  line names the top consumers (the records' five largest, in order), and writes the rank's report, which
  ``kc debug memory`` prints; the engine's worker does the same when its config's ``hal.memory_pool_size`` is too
  small (slow: a torchrun job).
- Counting activations leaves activation checkpointing alone: the same gradients and the same bytes held after the
  forward with the records on and off; the control, block hooks that ignore the checkpoint's, keeps far more.
"""

from __future__ import annotations

import contextlib

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from tests.mp import run_distributed

VOCAB, SEQ = 512, 32
TOLERANCE = 0.05  # the issue's: records within 5 % of the measured bytes


def _parts(zero_stage: int, alone: bool = False):
    """A tiny Llama, its GradSync over every rank (as ``make_grad_sync`` builds it for the job) and a batch;
    ``alone``: over a group of this rank only (the groups are made on every rank, as torch requires)."""
    import torch

    from kuangchao_core.comm import CommGroup
    from kuangchao_core.config.settings import GradSyncSettings
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM
    from kuangchao_core.parallel.grad_sync import make_grad_sync
    from kuangchao_core.parallel.mesh import ReduceGroups

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB))
    group = CommGroup([0, 1], backend="gloo", name=f"dp-z{zero_stage}")
    if alone:
        group = [CommGroup([r], backend="gloo", name=f"alone-{r}-z{zero_stage}") for r in (0, 1)][group.rank]
    settings = GradSyncSettings(
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.0,
        weight_decay_exclude=(),
        zero_stage=zero_stage,
        bucket_size_mb=0.25,
        grad_compression="none",
        grad_reduce_dtype="fp32",
        topk_ratio=0.01,
        topk_warmup_steps=0,
    )
    sync = make_grad_sync(settings, model, ReduceGroups(replicas=group, tp_group=None, pp_group=None), {})
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(group.rank))
    return model, sync, ids


def _loss(model, ids):
    from kuangchao_core.models.llama import causal_lm_loss

    return causal_lm_loss(model(ids), ids)


def settle() -> None:
    """Both ranks past the step, its garbage collected."""
    import gc

    import torch.distributed as dist

    dist.barrier()
    gc.collect()


def _records_and_measured(rank: int, world_size: int) -> dict:
    import gc

    from torch.profiler import ProfilerActivity, profile

    from kuangchao_core.engine.memory_ledger import MemoryLedger
    from kuangchao_core.hal import memory as hal_memory
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    out = {}
    for stage in (0, 2):
        gc.collect()
        hal_memory.release_unused()
        # the previous layout's buffers outlive it (its gradient hooks on the parameters hold it): allocated before
        # this window, they are not measured, so their bytes leave the records' sum too
        before = {ptr for *_, ptr in hal_memory.POOL.live_blocks()}
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model, sync, ids = _parts(stage, alone=stage == 2)
            ledger = MemoryLedger(model, sync).install()
            with ledger.tracking():
                sync.zero_grad()
                _loss(model, ids).backward()
                sync.finish()
            sync.step()
            settle()
            with ledger.tracking():
                loss = _loss(model, ids)  # the next step's forward: its activations are held
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        measured = sum(int(e.nbytes()) for e in events)
        leftover = sum(nbytes for *_, nbytes, ptr in ledger.storages() if ptr in before)
        out[stage] = {"records": ledger.records(), "leftover": leftover, "measured": measured}
        ledger.close()
        del model, sync, ids, loss, ledger
    return out


def _within(records: list[dict], measured: int, leftover: int = 0) -> bool:
    return abs(sum(r["bytes"] for r in records) - leftover - measured) <= TOLERANCE * measured


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_records_and_measured, 2, timeout=180)


@pytest.mark.parametrize("stage", [0, 2])
def test_records_sum_to_the_measured_bytes_of_each_rank(measured, stage):
    for rank, result in enumerate(measured):
        records, total = result[stage]["records"], result[stage]["measured"]
        assert total > 1_000_000, total  # a real measurement, not an empty one
        kinds = {(r["module"], r["kind"]) for r in records}
        engine = ("dp.grad_buckets", "grads") if stage == 0 else ("zero.flat_params", "params")
        assert engine in kinds, kinds  # the engine's buffers came from the HAL pool
        assert ("model.layers.0", "activations") in kinds and ("optimizer", "optimizer_state") in kinds, kinds
        leftover = result[stage]["leftover"]
        assert _within(records, total, leftover), (rank, sum(r["bytes"] for r in records), leftover, total, records)


def test_negative_control_records_without_the_optimizer_state_miss(measured):
    for result in measured:
        for stage in (0, 2):
            records, total = result[stage]["records"], result[stage]["measured"]
            kept = [r for r in records if r["kind"] != "optimizer_state"]
            assert _within(records, total, result[stage]["leftover"])  # the same figures pass with it
            assert not _within(kept, total, result[stage]["leftover"])


# ---------------------------------------------------------------------- a pool cap below the step's need
def _forced_oom(rank: int, world_size: int, dump: str) -> dict:
    from kuangchao_core.engine.memory_ledger import MemoryLedger
    from kuangchao_core.hal import memory as hal_memory
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    hal_memory.set_oom_dump(f"{dump}/rank_{rank:05d}.json")
    model, sync, ids = _parts(2)
    ledger = MemoryLedger(model, sync).install()
    # room for the set-up's flat shards, not for the bucket buffers the backward asks for
    hal_memory.configure_pool(limit_bytes=hal_memory.POOL.live_bytes + 1024)
    try:
        with ledger.tracking():
            _loss(model, ids).backward()
    except hal_memory.HalOutOfMemory as exc:
        message = str(exc)
    else:
        message = None
    hal_memory.configure_pool(limit_bytes=None)  # the control: without the cap the same step fits
    sync.zero_grad()
    with ledger.tracking():
        _loss(model, ids).backward()
    sync.finish()
    return {"message": message, "fits_without_cap": True}


def test_a_pool_cap_below_the_step_need_ends_with_one_message_naming_the_top_consumers(tmp_path):
    import json

    from kuangchao_core.hal.memory import top_consumers

    dumps = tmp_path / "debug" / "memory"
    results = run_distributed(_forced_oom, 2, args=(str(dumps),), timeout=120)
    for rank, result in enumerate(results):
        message = result["message"]
        assert message is not None and result["fits_without_cap"], "the step fit under the cap"
        assert "\n" not in message and message.startswith("out of memory: zero.grad_buckets (comm)"), message
        assert "hal.memory_pool_size" in message, message
        # the report written at the out-of-memory holds the records the message names, largest first
        records = json.loads((dumps / f"rank_{rank:05d}.json").read_text())["records"]
        top = top_consumers(records)
        assert message.endswith(f"top consumers: {top}"), (message, top)
        assert len(top.split(", ")) == 5 and "zero.flat_params params" in top and "activations" in top, top
    res = CliRunner().invoke(app, ["debug", "memory", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "== rank_00000" in res.output and "== rank_00001" in res.output, res.output
    assert "zero.flat_params" in res.output and "activations" in res.output and "records total" in res.output


# ---------------------------------------------------------------------- the engine's worker, capped by its config
@pytest.mark.slow
def test_the_worker_capped_by_hal_memory_pool_size_ends_with_the_oom_message_and_its_report(tmp_path):
    """A dp2 ZeRO-2 job under torchrun whose ``hal.memory_pool_size`` holds its flat shards (6 bytes a parameter:
    fp32 parameters, half the fp32 gradients) but not the step's bucket buffers: every rank ends with the one
    HalOutOfMemory line naming its top consumers, and ``kc debug memory RUN_DIR`` prints the reports it wrote."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kuangchao_core.models.llama import LlamaForCausalLM, config_from_model_section
    from tests.engine_helpers import tiny_job

    run_dir = tmp_path / "run"
    layout = {"data_parallel_size": 2, "zero_stage": 2}
    cfg = tiny_job(str(run_dir), parallel=layout, train={"steps": 3})
    params = sum(p.numel() for p in LlamaForCausalLM(config_from_model_section(cfg.model)).parameters())
    cfg = tiny_job(str(run_dir), parallel=layout, train={"steps": 3}, hal={"memory_pool_size": 6 * params + 4096})
    config = tmp_path / "job.yaml"
    config.write_text(cfg.to_yaml(), encoding="utf-8")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "KC_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "kuangchao_core.engine.worker", "--config", str(config), "--resume", "never"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0, done.stderr[-2000:]
    for rank in (0, 1):
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith(f"[rank{rank}]: ") and "HalOutOfMemory" in ln]
        assert len(lines) == 1, done.stderr[-4000:]
        assert "hal.memory_pool_size" in lines[0] and "top consumers: " in lines[0], lines[0]
        assert "zero.flat_params params" in lines[0] and "activations" in lines[0], lines[0]
        assert (run_dir / "debug" / "memory" / f"rank_{rank:05d}.json").is_file()
    res = CliRunner().invoke(app, ["debug", "memory", str(run_dir)])
    assert res.exit_code == 0 and "== rank_00001" in res.output and "zero.flat_params" in res.output, res.output


# ---------------------------------------------------------------------- counting leaves checkpointing alone
def _checkpointed_step(track: bool) -> tuple[list, int]:
    """Gradients of a ``full``-checkpointed tiny Llama, and the bytes its forward left held (profiler-measured)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kuangchao_core.engine.memory_ledger import MemoryLedger
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB))
    model.activation_checkpointing = "full"
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ledger = MemoryLedger(model) if track else None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with ledger.tracking() if track else contextlib.nullcontext():
            loss = _loss(model, ids)
    held = sum(int(e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    with ledger.tracking() if track else contextlib.nullcontext():
        loss.backward()
    if ledger is not None:
        ledger.close()
    return [p.grad for p in model.parameters()], held


def test_the_records_leave_what_checkpointing_keeps_unchanged(monkeypatch):
    import torch

    plain_grads, plain_held = _checkpointed_step(track=False)
    grads, held = _checkpointed_step(track=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    assert held == plain_held  # the checkpointed layers still keep only their inputs
    # negative control: block hooks that ignore the checkpoint's (as if none were active) keep every activation
    monkeypatch.setattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda *_: None)
    _, sabotaged = _checkpointed_step(track=True)
    assert sabotaged > 2 * plain_held, (sabotaged, plain_held)


# ---------------------------------------------------------------------- the config field
def test_hal_memory_pool_size_is_validated_under_its_field_path():
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.errors import ConfigError

    assert config_from_dict({"task": {"name": "t"}}).hal.memory_pool_size is None  # no cap by default
    cfg = config_from_dict({"task": {"name": "t"}, "hal": {"memory_pool_size": 1 << 20}})
    assert cfg.hal.memory_pool_size == 1 << 20
    for bad in ({"memory_pool_size": 0}, {"memory_pool_size": "lots"}, {"pool_size": 1}):
        with pytest.raises(ConfigError) as err:
            config_from_dict({"task": {"name": "t"}, "hal": bad})
        assert f"hal.{next(iter(bad))}" in str(err.value), str(err.value)


def test_cuda_records_name_the_allocator_snapshot_blocks_by_their_storage(monkeypatch):
    """The CUDA path cannot run here (no GPU in CI): its attribution is checked on a snapshot in the documented
    form of ``torch.cuda.memory_snapshot()`` — active blocks named by the storage at their address, sized as the
    allocator holds them; free blocks and other devices left out; blocks no storage owns ``(unattributed)``."""
    import torch

    from kuangchao_core.engine.memory_ledger import cuda_snapshot_totals

    snapshot = [
        {
            "device": 0,
            "blocks": [
                {"address": 4096, "size": 1024, "state": "active_allocated"},
                {"address": 5120, "size": 512, "state": "active_allocated"},
                {"address": 5632, "size": 512, "state": "inactive"},
                {"address": 6144, "size": 2048, "state": "active_allocated"},
            ],
        },
        {"device": 1, "blocks": [{"address": 4096, "size": 99, "state": "active_allocated"}]},
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    owners = {4096: ("model.layers.0", "params"), 6144: ("optimizer", "optimizer_state")}
    assert cuda_snapshot_totals(owners, torch.device("cuda", 0)) == {
        ("model.layers.0", "params"): 1024,
        ("(unattributed)", "cuda"): 512,
        ("optimizer", "optimizer_state"): 2048,
    }


def test_a_wrapped_step_is_tracked_first_and_every_nth_and_the_records_keep_its_peaks(monkeypatch):
    """``MemoryLedger.wrap(step, every=3)`` counts the saved tensors of calls 0 and 3 only (the hooks cost ~9 % of a
    tiny model's step); between them the records list each block's peak of the last tracked step as
    ``activations_peak`` (nothing held now), the same at the same shape. Control: ``every=1`` counts every call."""
    import torch

    from kuangchao_core.engine.memory_ledger import MemoryLedger
    from kuangchao_core.models.llama import LlamaForCausalLM
    from tests.fixtures import tiny_llama

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama())
    ids = torch.randint(0, 256, (2, 16))

    def step():
        _loss(model, ids).backward()

    def holds_per_call(every: int, calls: int) -> tuple[list[int], list[dict]]:
        ledger = MemoryLedger(model)
        counted, real = [], ledger._hold
        monkeypatch.setattr(ledger, "_hold", lambda t, block: counted.append(block) or real(t, block))
        wrapped, per_call, peaks = ledger.wrap(step, every=every), [], []
        for _ in range(calls):
            before = len(counted)
            wrapped()
            per_call.append(len(counted) - before)
            peaks.append({r["module"]: r["bytes"] for r in ledger.records() if r["kind"] == "activations_peak"})
        ledger.close()
        return per_call, peaks

    per_call, peaks = holds_per_call(every=3, calls=4)
    assert per_call[0] > 0 and per_call[3] == per_call[0] and per_call[1] == per_call[2] == 0, per_call
    assert "model.layers.0" in peaks[0] and peaks[0] == peaks[1] == peaks[2] == peaks[3], peaks
    control, _ = holds_per_call(every=1, calls=3)
    assert control == [per_call[0]] * 3, control

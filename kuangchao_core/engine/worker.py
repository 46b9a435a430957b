"""Worker entry point, started by ``torch.distributed.run`` (one process per rank).

    python -m kuangchao_core.engine.worker --config RESOLVED.yaml [--resume auto|never|PATH]

Environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (from torchrun); optional ``KC_MLFLOW_RUN_ID`` +
``KC_TRACKING_URI`` (rank 0 logs metrics), ``KC_HEARTBEAT_DIR`` (heartbeats for the launcher),
``KC_LIFELINE`` (the launcher's socket: this rank's own two tokens, and the rank ends when the launcher dies; see
``sched.lifeline``) or ``KC_TOKENS`` (the worker keeps its own two and removes the variable), ``KC_TRUST_STORE`` +
``KC_TRUST_ROOT`` (the signed trust store and its signer), ``KC_JOB_ID``/``KC_ATTEMPT``,
``KC_GLOBAL_CONFIG`` (the job's global configuration file, followed by the trainer); ``KC_RANK_MAP`` /
``KC_NODE_OF_RANK`` (the placement: which mesh rank each torch rank plays, and the node of every mesh rank).
Sequence: config → settings → device_init → guard → comm groups → model → data → steps → checkpoints. The worker
is where the validated config becomes the run's typed settings (:func:`~kuangchao_core.config.settings.run_settings`);
the trainer and everything below it receive those, not the config.
"""

from __future__ import annotations

import argparse
import logging
import os
from functools import partial

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from kuangchao_core.comm.order_check import verify_order
from kuangchao_core.config import load_config
from kuangchao_core.config.settings import ProcessSettings, run_settings
from kuangchao_core.config.unused import UNUSED_REPORTED_ENV, unused_settings
from kuangchao_core.hal.memory import out_of_memory
from kuangchao_core.obs.jsonlog import emit_event, log_event, setup_logging
from kuangchao_core.sched.error_file import AtomicErrorHandler
from kuangchao_core.sched.heartbeat import HeartbeatWriter

log = logging.getLogger("kuangchao.engine.worker")
#: the least number of steps between two steps whose activations the memory records count
ACTIVATION_RECORDS_EVERY = 100


def _install_guard(process: ProcessSettings, rank: int) -> None:
    """The rank's guards: ``worker-<rank>`` for the process, ``data_loader-<rank>`` for its dataset reads."""
    from kuangchao_core import guard_api
    from kuangchao_core.perm.runtime import install_from_environment, take_environment_tokens

    tokens = take_environment_tokens()
    if process.permission_mode == "trusted":
        log.warning("permission.mode is TRUSTED: capability checks are OFF for module worker-%d", rank)
        guard_api.install_guard(guard_api.AllowAll())
        return
    install_from_environment(rank, tokens, os.environ.get("KC_AUDIT_LOG") or process.audit_log)


@partial(record, error_handler=AtomicErrorHandler())  # a whole error file or none, for torchrun's report
def main(argv: list[str] | None = None) -> int:
    """Run one worker; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="kuangchao-worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--resume", default=None, help="auto | never | PATH (default: checkpoint.resume)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (testing)")
    args = parser.parse_args(argv)

    from kuangchao_core.sched.rank_placement import apply_rank_map, node_of_rank_from_env

    apply_rank_map()  # the mesh rank this slot plays, before anything reads RANK
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg = load_config(args.config)
    run = run_settings(cfg)
    proc = run.process
    setup_logging(f"worker-{rank}", rank, proc.log_level, json_file=_json_log_path(proc, rank))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if proc.deterministic:  # before device_init: cuBLAS reads its workspace setting at its first handle
        from kuangchao_core.hal.determinism import enable_determinism

        enable_determinism(proc.device, os.environ)

    if os.environ.get("KC_RUN_DIR"):  # SIGUSR1 / a collective timeout: state dumps for `kc debug comm|memory`
        from kuangchao_core.engine.debug_dumps import dump_on_signal

        dump_on_signal(os.environ["KC_RUN_DIR"], rank)
    heartbeat = HeartbeatWriter.from_env(rank)
    if heartbeat is not None:
        heartbeat.start()

    _install_guard(proc, rank)
    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.engine.plan import raise_for_plan
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.hal import device_init
    from kuangchao_core.parallel.mesh import ParallelMesh

    ctx = device_init(proc.device, local_rank=local_rank)
    _memory_pool(cfg, rank)
    init_distributed(backend=proc.backend, timeout_ms=proc.timeout_ms)
    raise_for_plan(cfg, world_size)
    world = world_group()
    mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size, node_of_rank=node_of_rank_from_env(world_size))
    log_event(log, "worker ready", device=str(ctx.device), world_size=world_size, mesh=repr(mesh))

    sink = None
    run_id = os.environ.get("KC_MLFLOW_RUN_ID")
    if rank == 0 and run_id:
        from kuangchao_core.obs.mlflow_sink import MlflowMetricSink

        sink = MlflowMetricSink(os.environ.get("KC_TRACKING_URI", proc.tracking_uri), run_id, task=proc.task)

    system = None
    if run_id and local_rank == 0 and proc.system_metrics:  # one monitor per node
        import socket

        from kuangchao_core.obs.system_metrics import start_system_metrics

        node = os.environ.get("KC_NODE") or socket.gethostname()
        uri = os.environ.get("KC_TRACKING_URI", proc.tracking_uri)
        system = start_system_metrics(uri, run_id, node, proc.task, proc.system_metrics_interval_s)

    if rank == 0 and not os.environ.get(UNUSED_REPORTED_ENV):  # under a flow the orchestrator has said them
        for path, why in unused_settings(cfg):  # never silently dropped
            log.warning("%s: %s", path, why)
    trainer = Trainer(run, rank, world_size, ctx.device, world, mesh)
    _memory_records(trainer, run)
    global_config = os.environ.get("KC_GLOBAL_CONFIG")
    if global_config:  # the trainer follows the job's changeable settings (lr_scale, log/checkpoint interval)
        from kuangchao_core.engine.live_config import worker_global_config

        # verified, this job's, and never older than the newest version the job recorded (no rollback)
        trainer.global_config = worker_global_config(proc, global_config)
    resume = args.resume or run.checkpoint.resume
    try:
        # a flow run pins the lineage for all its attempts (KC_CKPT_LINEAGE); a bare worker decides it itself
        lineage = os.environ.get("KC_CKPT_LINEAGE") or None
        state = trainer.run(resume=resume, metric_sink=sink, max_steps=args.max_steps, lineage=lineage)
        if trainer.stopped_at is not None:  # asked to stop (a Slurm time limit close): checkpointed, no final eval
            verify_order(trainer.host_group, final=True)
            if rank == 0:
                from kuangchao_core.engine.live_config import ENV_STOP_FILE, acknowledge_stop

                acknowledge_stop(os.environ[ENV_STOP_FILE], trainer.stopped_at)
            return 0
        _final_eval(trainer, sink, run.evaluation.samples_at_end)  # collective: every rank answers the prompts
        verify_order(trainer.host_group, final=True)  # CI's NCCL rules: the run's last ops replayed (else a no-op)
        if rank == 0:
            final_loss = state.losses[-1] if state.losses else None
            # step time only, and the whole loop with its evaluations and checkpoints (issue 39 item 1)
            finals = {
                "final_loss": final_loss,
                "tokens_per_s_mean": state.tokens_per_s_mean,
                "tokens_per_s_loop": state.tokens_per_s_loop,
                "eval_seconds": trainer.evaluate.seconds,
                "heldout": trainer.evaluate.last_heldout,  # the latest held-out loss, per token, char and byte
            }
            emit_event("done", step=state.step, **finals)
            if sink is not None:  # run-level values, at the final step with the rest
                sink.log_final({k: v for k, v in finals.items() if v is not None and k != "heldout"}, state.step)
    except torch.OutOfMemoryError as exc:  # the device's: one message naming the top consumers, as the pool's
        error = out_of_memory(f"the device: {str(exc).splitlines()[0]}")
        emit_event("fault", rank=rank, step=trainer.state.step, error=f"{type(error).__name__}: {error}")
        raise error from None
    except Exception as exc:  # said once as an event, so the orchestrator can tell a fault that repeats identically
        emit_event("fault", rank=rank, step=trainer.state.step, error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if system is not None:
            system.finish()
        if sink is not None:
            sink.close()
        if heartbeat is not None:
            heartbeat.stop()
    return 0


def _memory_pool(cfg, rank: int) -> None:
    """The HAL pool capped at ``hal.memory_pool_size``; an out-of-memory writes this rank's report where
    ``kc debug memory RUN_DIR`` reads it (issue 44)."""
    from kuangchao_core.hal.memory import configure_pool, set_oom_dump

    configure_pool(limit_bytes=cfg.hal.memory_pool_size)
    if os.environ.get("KC_RUN_DIR"):
        from kuangchao_core.engine.debug_dumps import dump_dir

        set_oom_dump(dump_dir(os.environ["KC_RUN_DIR"], "memory") / f"rank_{rank:05d}.json")


def _memory_records(trainer, run) -> None:
    """Per-module records of this rank (activations per block counted in the first step's forward-backward and every
    :data:`ACTIVATION_RECORDS_EVERY`-th or ``train.log_interval``-th, the larger, except in compiled layers), then the
    set-up's freed pool blocks released."""
    from kuangchao_core.engine.memory_ledger import MemoryLedger
    from kuangchao_core.hal.memory import release_unused

    ledger = MemoryLedger(trainer.model, trainer.sync, track_activations=not run.build.compile).install()
    every = max(ACTIVATION_RECORDS_EVERY, run.train.log_interval)  # the hooks cost ~9 % of a tracked tiny step
    trainer.forward_backward = ledger.wrap(trainer.forward_backward, every=every)
    release_unused()


def _json_log_path(proc: ProcessSettings, rank: int) -> str | None:
    run_dir = os.environ.get("KC_RUN_DIR")
    if proc.json_log:
        return proc.json_log.replace("{rank}", str(rank))
    return os.path.join(run_dir, "logs", f"worker-{rank}.jsonl") if run_dir else None


def _final_eval(trainer, sink, at_end: bool) -> None:
    """Exact match of the final model's greedy answers to the held-out prompts (where the data has answers), logged
    and reported by rank 0 with a few sample answers, when ``at_end`` (``train.samples.at_end``, or a champion metric
    that needs it); an evaluation's samples at the last step are reused. Its time counts in the whole loop's.
    Collective (TP ranks gather logits; ZeRO-3 gathers blocks)."""
    if trainer.samples is None or not at_end:
        return
    before = trainer.evaluate.seconds
    accuracy, text = trainer.evaluate.final(trainer.state.step)
    trainer.state.loop_seconds += trainer.evaluate.seconds - before
    if trainer.rank != 0:
        return
    corpus = getattr(trainer.dataset, "corpus", None)
    documents = trainer.run_settings.batches.documents
    floor = float(corpus.loss_floor(documents)) if corpus is not None and hasattr(corpus, "loss_floor") else None
    log_event(log, "eval", heldout_accuracy=accuracy, loss_floor=floor)
    emit_event("eval", heldout_accuracy=accuracy, loss_floor=floor, samples=text)
    if sink is not None:
        finals = {"heldout_accuracy": accuracy, "loss_floor": floor}
        sink.log_final({k: v for k, v in finals.items() if v is not None}, trainer.state.step)
        sink.log_text(f"final model: greedy answers to held-out prompts\n\n{text}", "samples/final.txt")


if __name__ == "__main__":
    from kuangchao_core.sched.fast_exit import exit_now

    exit_now(main())  # the run is over: no interpreter teardown (seconds of CPU per rank on a loaded machine)

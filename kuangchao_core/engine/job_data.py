"""The job's training data and its held-out evaluators, text or image (issue 31), for the trainer.

Text jobs: :func:`~kuangchao_core.data.build_dataset` and the held-out loss and greedy samples of
:mod:`~kuangchao_core.engine.evaluation` and :mod:`~kuangchao_core.engine.samples`, as ``train.eval_tokens`` and
``train.samples`` ask (rank 0 logs what an evaluation covers once, at start). Jobs with ``model.vision``:
the gated image datasets and their evaluators (:mod:`~kuangchao_core.engine.vlm_data`).
"""

from __future__ import annotations

import logging
from typing import Any

from kuangchao_core.data import build_dataset
from kuangchao_core.engine.evaluation import eval_dataset_for, eval_windows, held_out_loss_for
from kuangchao_core.engine.samples import sample_evaluator_for
from kuangchao_core.obs.jsonlog import log_event

log = logging.getLogger("kuangchao.engine")


def job_data(run: Any, parts: Any, mesh: Any, device: Any, model_config: Any, rank: int) -> tuple[Any, Any, Any]:
    """``(train dataset, held-out loss or None, greedy samples or None)`` for this rank (``model_config``: the built
    model's, its vocabulary and context length); what a job without held-out data (or samples) lacks is said once,
    on rank 0."""
    vocab_size, evaluation = model_config.vocab_size, run.evaluation
    micro, eval_interval = run.batches.micro_batch_size, run.train.eval_interval
    if run.model.vision is not None:
        from kuangchao_core.engine.vlm_data import held_out_for_vision, vision_datasets

        train, held_out, tokenizer = vision_datasets(run.data, run.model.vision, vocab_size, run.build.dtype)
        if held_out is None:
            if rank == 0:
                log.warning("train.eval_interval %d: no held-out loss: set data.eval_path", eval_interval)
            return train, None, None
        loss, answers = held_out_for_vision(parts, mesh, held_out, tokenizer, micro, device)
        return train, loss, answers if evaluation.sample_count > 0 else None
    train = build_dataset(run.data, vocab_size)
    eval_data, no_eval = eval_dataset_for(run.data, run.batches.no_eval_reason, vocab_size)
    if eval_data is None:
        if rank == 0:
            log.warning("train.eval_interval %d: no held-out loss for this job: %s", eval_interval, no_eval)
        return train, None, None
    windows = eval_windows(evaluation.eval_tokens, int(run.data.seq_len))
    evaluator = held_out_loss_for(micro, parts, mesh, eval_data, device, windows)
    samples, no_samples = sample_evaluator_for(
        parts,
        mesh,
        eval_data,
        device,
        model_config.max_seq_len,
        evaluation.sample_count,
        evaluation.sample_max_new,
        run.build.zero_stage,
    )
    if rank == 0:
        log_event(
            log,
            "evaluation",
            held_out_windows=evaluator.windows,
            of_windows=len(eval_data),
            eval_tokens=evaluation.eval_tokens,
            samples=0 if samples is None else len(samples.cases),
            sample_new_tokens=None if samples is None else samples.max_new,
            samples_every=evaluation.sample_every,
            samples_at_end=evaluation.samples_at_end,
            kv_cache=samples is not None and samples.decoder is not None,
        )
        if samples is None:
            log.info("no greedy samples at evaluations: %s", no_samples)
    return train, evaluator, samples

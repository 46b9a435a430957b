"""The evaluations of the step loop (issue 39 item 1): when each runs, what it reports, what it cost.

The held-out loss (:mod:`~kuangchao_core.engine.evaluation`) runs every ``train.eval_interval`` steps, the greedy
samples (:mod:`~kuangchao_core.engine.samples`) every ``train.samples.every`` steps (by default the same steps);
each evaluation's wall time is the metric ``eval_time_s`` beside the step's own ``step_time_s``, and the run's
evaluation time adds up in :attr:`StepEvaluations.seconds`. The final model's samples (``train.samples.at_end``) reuse
the samples of an evaluation at the same step instead of decoding them again. Where the tokenizer says what text
its tokens spell, the held-out loss is also given per character and per byte (``eval_nats_per_char``,
``eval_bits_per_byte``: the loss summed over the evaluated tokens, divided by the characters or bytes they spell;
:mod:`~kuangchao_core.data.token_bytes`), and the latest held-out figures are kept for the run's summary.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from kuangchao_core.engine.vlm_data import log_sample_images
from kuangchao_core.obs.jsonlog import emit_event, log_event

log = logging.getLogger("kuangchao.engine")


class StepEvaluations:
    """The loop's evaluations of one rank: ``evaluator`` (held-out loss) and ``samples`` (greedy samples), each
    None when the job has none. Collective: call on every rank at every step."""

    def __init__(self, evaluator: Any, samples: Any, eval_interval: int, samples_every: int, rank: int):
        self.evaluator, self.samples, self.rank = evaluator, samples, rank
        self.eval_interval, self.samples_every = int(eval_interval), int(samples_every)
        self.seconds = 0.0  # the wall time of this run's evaluations
        self.last: tuple[int, float | None, str] | None = None  # (step, exact match, text) of the latest samples
        self.last_heldout: dict[str, Any] | None = None  # the latest held-out loss with what it covered

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether the held-out loss and whether the samples run at ``step``."""
        loss = self.evaluator is not None and step % self.eval_interval == 0
        return loss, self.samples is not None and step % self.samples_every == 0

    def __call__(self, step: int, metrics: dict[str, float], metric_sink: Any, every: bool = False) -> None:
        """Run what is due at ``step`` (``every``: both, as at the start of a fine-tune) into ``metrics``; rank 0
        reports them and logs the samples as the MLflow text artifact ``samples/step_<N>.txt``."""
        loss_due, samples_due = (self.evaluator is not None, self.samples is not None) if every else self.due(step)
        if not (loss_due or samples_due):
            return
        t0 = time.perf_counter()
        fields: dict[str, Any] = {"step": step}
        if loss_due:
            metrics["eval_loss"] = fields["eval_loss"] = self.evaluator()
            fields |= {"eval_tokens": self.evaluator.tokens, "eval_windows": self.evaluator.windows}
            fields |= per_text(fields["eval_loss"], self.evaluator)
            metrics.update({k: fields[k] for k in ("eval_nats_per_char", "eval_bits_per_byte") if k in fields})
            self.last_heldout = dict(fields)
        text = None
        if samples_due:
            accuracy, text = self.samples()
            self.last = (step, accuracy, text)
            fields["samples"] = len(self.samples.cases) if hasattr(self.samples, "cases") else None
            if accuracy is not None:
                metrics["eval_exact_match"] = fields["eval_exact_match"] = accuracy
        metrics["eval_time_s"] = fields["eval_time_s"] = time.perf_counter() - t0
        self.seconds += fields["eval_time_s"]
        if self.rank != 0:
            return
        log_event(log, "eval_loss" if loss_due else "samples", **fields)
        if loss_due:
            emit_event("eval_loss", **fields)
        if text is not None and metric_sink is not None and hasattr(metric_sink, "log_text"):
            metric_sink.log_text(
                f"step {step}: greedy answers to held-out prompts\n\n{text}", f"samples/step_{step:08d}.txt"
            )
            log_sample_images(metric_sink, self.samples, step)  # a vision job's answers with their images

    def baseline(self, metric_sink: Any) -> None:
        """A fine-tune's starting point, to read every later evaluation against: both evaluations at step 0 (none
        when the job has no held-out loss), reported to ``metric_sink`` by rank 0. Collective."""
        if self.evaluator is None:
            return
        before: dict[str, float] = {}
        self(0, before, metric_sink, every=True)
        if metric_sink is not None and self.rank == 0:
            metric_sink.log_step(0, before)

    def final(self, step: int) -> tuple[float | None, str]:
        """The final model's samples at ``step`` (the last): an evaluation's at that step, else decoded now (its
        time counted in :attr:`seconds`). Collective."""
        if self.last is not None and self.last[0] == step:
            return self.last[1], self.last[2]
        t0 = time.perf_counter()
        accuracy, text = self.samples()
        self.seconds += time.perf_counter() - t0
        self.last = (step, accuracy, text)
        return accuracy, text


def per_text(loss: float, evaluator: Any) -> dict[str, Any]:
    """The held-out loss per character and per byte of the text its tokens spell, with those counts (empty when
    the tokenizer cannot say): ``loss × tokens / chars`` nats, ``loss × tokens / bytes / ln 2`` bits."""
    n_bytes, n_chars = getattr(evaluator, "text_bytes", None), getattr(evaluator, "text_chars", None)
    if not n_bytes or not n_chars or not math.isfinite(loss):
        return {}
    total = loss * evaluator.tokens  # nats over the evaluated tokens
    return {
        "eval_bytes": n_bytes,
        "eval_chars": n_chars,
        "eval_nats_per_char": total / n_chars,
        "eval_bits_per_byte": total / n_bytes / math.log(2),
    }

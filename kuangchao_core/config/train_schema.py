"""The ``train`` section of the job config: the step loop, its anomaly thresholds, fp16 loss scaling and the
evaluation (``eval_interval``, ``eval_tokens``, ``samples``; issue 39 item 1).

Split from :mod:`.schema` (which re-exports these names) so that file stays under its size ceiling; the config
reference reads them in the same order.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kuangchao_core.config.section import Float, Int, Section

#: held-out prompts answered at each evaluation where the data has answers (synthetic corpus, sft records)
ANSWER_CASES = 256
#: a text sample's prompt (the first tokens of a held-out window) and the tokens generated after it
TEXT_PROMPT_TOKENS = 24
TEXT_NEW_TOKENS = 48


class SamplesSection(Section):
    """Greedy samples at evaluations (:mod:`kuangchao_core.engine.samples`): held-out prompts answered greedily,
    scored by exact match where the data has answers (the synthetic corpus, sft records) and shown as text; decoded
    with a key/value cache where the layout allows (not under a pipeline, ZeRO-3 or sequence parallelism)."""

    #: held-out prompts per sampling; unset: 256 where the data has answers, 0 (off) for plain text (no answers)
    count: Int | None = Field(default=None, ge=0, le=1_000_000)
    #: tokens generated per prompt; unset: the longest held-out answer, or 48 for text
    max_new_tokens: Int | None = Field(default=None, ge=1, le=1_000_000)
    #: steps between samplings; unset: ``train.eval_interval`` (any other value is its own cadence)
    every: Int | None = Field(default=None, ge=1)
    #: sample the final model once after the last step (the run's ``heldout_accuracy``); unset: where the data has
    #: answers. ``tracking.champion_metric: heldout_accuracy`` with ``tracking.register_model`` turns it on
    at_end: bool | None = None


AnomalyAction = Literal["warn", "checkpoint", "stop"]
AnomalyKind = Literal["comm_share", "grad_norm", "loss_nan", "loss_spike", "memory_growth"]
#: the action of an anomaly kind that ``train.anomaly.actions`` does not name (any other kind: ``warn``)
ANOMALY_DEFAULT_ACTIONS: dict[str, str] = {"loss_nan": "stop"}


class AnomalySection(Section):
    """What counts as an anomaly (RT.6) and what to do about each kind.

    ``comm_share``: the median communication share of step time over the last ``comm_share_steps`` steps above
    this, raised to where communication takes ``comm_baseline_factor`` (4) times this run's own baseline time
    relative to compute (the baseline is the median of the first ``comm_share_steps`` steps after warm-up,
    ``engine.anomaly.comm_share_limit``; 0 judges against ``comm_share`` alone);
    ``grad_norm_factor``: a gradient norm above this multiple of the median of the last ``window`` steps for
    ``grad_norm_steps`` steps in a row (one step's outlier is common in heavy-tailed gradients near convergence, and
    ``optimizer.max_grad_norm`` clips it; an explosion lasts);
    ``loss_spike_factor``: a loss above this multiple of that median and at least ``loss_spike_min_delta`` nats over
    it (a NaN or infinite loss is always one). Loss and gradient norm are judged only after ``train.warmup_steps``
    and a full ``window`` of steps after them (the median needs them; early steps move fast by design);
    ``memory_growth_mb``: memory in use growing by more than this between two steps. ``actions``: per kind
    (``comm_share``, ``grad_norm``, ``loss_nan``, ``loss_spike``, ``memory_growth``) ``warn``, ``checkpoint`` or
    ``stop``; the default is ``stop`` for ``loss_nan`` (a diverged run ends with an error and publishes nothing) and
    ``warn`` for every other kind (:data:`ANOMALY_DEFAULT_ACTIONS`); ``comm_share`` and ``memory_growth`` are
    measured per rank, so they only warn. ``loss_nan: warn`` keeps training past a non-finite loss: the step is
    skipped and ``train.max_bad_steps`` of them in a row stop the run."""

    comm_share: Float = Field(default=0.30, gt=0, le=1)
    comm_share_steps: Int = Field(default=50, ge=1, le=10000)
    comm_baseline_factor: Float = Field(default=4.0, ge=0, le=1000)
    grad_norm_factor: Float = Field(default=10.0, gt=1)
    grad_norm_steps: Int = Field(default=3, ge=1, le=10000)
    loss_spike_factor: Float = Field(default=3.0, gt=1)
    loss_spike_min_delta: Float = Field(default=0.5, ge=0)
    window: Int = Field(default=20, ge=3, le=10000)
    memory_growth_mb: Float = Field(default=1024.0, gt=0)
    actions: dict[AnomalyKind, AnomalyAction] = Field(default_factory=dict)

    @field_validator("actions")
    @classmethod
    def _local_kinds_only_warn(cls, value: dict) -> dict:
        bad = [k for k in ("comm_share", "memory_growth") if value.get(k, "warn") != "warn"]
        if bad:
            raise ValueError(f"{bad} are measured on each rank separately and can only warn (ranks could disagree)")
        return value


class LossScalingSection(Section):
    """Dynamic loss scaling of ``train.dtype: fp16``: the scale doubles after ``growth_interval`` clean steps in a
    row and halves after ``hysteresis`` steps whose gradients overflowed (each skipped)."""

    initial_scale: Float = Field(default=2.0**16, gt=0, le=2.0**32)
    growth_interval: Int = Field(default=2000, ge=1)
    hysteresis: Int = Field(default=1, ge=1)


class TrainSection(Section):
    """The training loop: ``steps`` counts optimizer steps."""

    steps: Int = Field(default=100, ge=1, le=10**12)
    warmup_steps: Int = Field(default=0, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: Float = Field(default=0.1, ge=0, le=1)
    log_interval: Int = Field(default=1, ge=1)
    eval_interval: Int = Field(default=50, ge=1)
    #: held-out tokens each evaluation's loss covers (whole windows of ``data.seq_len``, the first ones of the
    #: held-out split); unset: the whole held-out split
    eval_tokens: Int | None = Field(default=None, ge=1)
    samples: SamplesSection = Field(default_factory=SamplesSection)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["fp32", "fp64", "bf16", "fp16"] = "fp32"
    param_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: bf16 parameters, fp32 master weights in the optimizer
    #: recompute decoder layers in the backward instead of keeping their activations: ``full`` keeps each layer's
    #: input only, ``selective`` keeps matmul and attention outputs and recomputes the rest
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    #: compile each decoder layer with ``torch.compile`` (inductor; the first steps pay the compilation)
    compile: bool = False
    loss_scaling: LossScalingSection = Field(default_factory=LossScalingSection)
    deterministic: bool = False
    #: a step whose loss or gradient norm is not finite is skipped on every rank; this many in a row stop the run
    #: at its last good checkpoint (fp16 counts them only once the loss scale is at its minimum)
    max_bad_steps: Int = Field(default=10, ge=1)
    anomaly: AnomalySection = Field(default_factory=AnomalySection)

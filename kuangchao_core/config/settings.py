"""The settings a worker's engine runs on: small frozen objects, built once from the validated job config.

The worker reads its config file, validates it (:class:`~kuangchao_core.config.schema.JobConfig`) and calls
:func:`run_settings` — the one place below the orchestrator that reads the config's fields for a training run.
Everything after it (the trainer, its checkpoints, the model builder, the gradient sync, the precision policy, the
held-out evaluation, the followed global config) receives the object it needs and never the config, so a change of
the config's shape touches this module and the schema, not the step loop.

Two sections go on whole to the layer that owns their meaning: ``model`` (the model layer turns it into a
``LlamaConfig``) and ``data`` (the data layer builds the dataset from it). ``RunSettings.job`` keeps the validated
config for the one whole-job report that needs every section (``kc plan``'s memory estimate, logged beside the
measured memory after the first step); nothing reads fields through it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kuangchao_core.config.train_schema import ANSWER_CASES


@dataclass(frozen=True)
class TrainSettings:
    """The step loop's schedule and limits (``train.*`` with ``optimizer.lr``/``max_grad_norm`` and the seed)."""

    seed: int
    steps: int
    warmup_steps: int
    lr: float
    lr_schedule: str
    min_lr_ratio: float
    max_grad_norm: float
    log_interval: int
    eval_interval: int
    max_bad_steps: int
    anomaly: Any  # the ``train.anomaly`` section, read by the anomaly detector
    #: ``model.checkpoint``: pretrained weights to start from (or None)
    pretrained: str | None


@dataclass(frozen=True)
class PrecisionSettings:
    """``train.dtype`` and its fp16 loss scaling."""

    dtype: str
    initial_scale: float
    growth_interval: int
    hysteresis: int


@dataclass(frozen=True)
class ModelBuildSettings:
    """How this rank's model part is built: seed, parameter dtype, recomputation, compilation, LoRA, virtual stages."""

    seed: int
    dtype: str
    param_dtype: str  # ``train.param_dtype``: fp32, or bf16 (fp32 master weights held by the optimizer)
    activation_checkpointing: str
    compile: bool
    lora: Any  # the ``model.lora`` section or None
    virtual_pipeline_size: int
    pipeline_schedule: str
    zero_stage: int
    sequence_parallel: bool = False  # ``parallel.sequence_parallel``: activations between TP blocks split along s


@dataclass(frozen=True)
class GradSyncSettings:
    """The optimizer and gradient exchange ``parallel.zero_stage`` asks for, with the AdamW hyperparameters."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    weight_decay_exclude: tuple[str, ...]
    zero_stage: int
    bucket_size_mb: float
    grad_compression: str
    grad_reduce_dtype: str
    topk_ratio: float
    topk_warmup_steps: int
    param_dtype: str = "fp32"  # ``train.param_dtype``: bf16 keeps fp32 master weights in the optimizer


@dataclass(frozen=True)
class BatchSettings:
    """How batches are cut and fed: micro-batch size, accumulation, shuffling, prefetch depth, document packing."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    shuffle: bool
    prefetch: int
    documents: bool  # ``data.packing: documents``: each sequence is one document (the loss floor knows it)
    #: why the job has no held-out data (``""`` when it has some to try)
    no_eval_reason: str


@dataclass(frozen=True)
class EvalSettings:
    """What each evaluation covers (``train.eval_tokens``, ``train.samples``; issue 39 item 1), defaults resolved
    for the job's data by :func:`eval_settings`."""

    eval_tokens: int | None  # held-out tokens of each held-out loss; None: the whole held-out split
    sample_count: int  # held-out prompts answered greedily per sampling; 0: no samples
    sample_max_new: int | None  # tokens generated per prompt; None: the longest held-out answer (text: 48)
    sample_every: int  # steps between samplings
    samples_at_end: bool  # the final model sampled once after the last step (``heldout_accuracy``)


def data_has_answers(cfg: Any) -> bool:
    """Whether the job's held-out data has answers that greedy samples can score (the synthetic corpus, sft records,
    image questions); plain text has none."""
    data = cfg.data
    return bool(data.is_synthetic or data.format == "sft" or cfg.model.vision is not None)


def eval_settings(cfg: Any) -> EvalSettings:
    """:class:`EvalSettings` of a validated config: samples on (256 prompts) where the data has answers, off for
    plain text; at the end where the data has answers, or where a registered model's champion metric is
    ``heldout_accuracy`` (the final samples compute it)."""
    train, answers = cfg.train, data_has_answers(cfg)
    samples = train.samples
    count = int(samples.count if samples.count is not None else (ANSWER_CASES if answers else 0))
    at_end = answers if samples.at_end is None else bool(samples.at_end)
    champion = bool(cfg.tracking.register_model) and cfg.tracking.champion_metric == "heldout_accuracy"
    return EvalSettings(
        eval_tokens=None if train.eval_tokens is None else int(train.eval_tokens),
        sample_count=count,
        sample_max_new=None if samples.max_new_tokens is None else int(samples.max_new_tokens),
        sample_every=int(samples.every or train.eval_interval),
        samples_at_end=count > 0 and (at_end or champion),
    )


@dataclass(frozen=True)
class LineageKey:
    """What names a job's checkpoint lineages (:mod:`kuangchao_core.ckpt.lineage`): where they live, the task, the
    fingerprint of what makes two runs the same training, the config's hash, and the steps a lineage trains to."""

    dir: str
    task: str
    fingerprint: str  # sha256 of model, data and seed (not steps or lr): two runs with it may continue each other
    config_hash: str
    steps: int  # ``train.steps``: a lineage at or past it is finished


def lineage_key(cfg: Any) -> LineageKey:
    """The :class:`LineageKey` of a validated job config."""
    what = {"model": cfg.model.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json"), "seed": cfg.task.seed}
    return LineageKey(
        dir=cfg.checkpoint.dir,
        task=cfg.task.name,
        fingerprint=hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest(),
        config_hash=cfg.config_hash(),
        steps=int(cfg.train.steps),
    )


@dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints go and what they record (``checkpoint.*``, the task, and the layout written beside them)."""

    dir: str
    task: str
    seed: int
    pretrained: str | None  # ``model.checkpoint``, the frozen base a LoRA checkpoint names
    interval: int
    keep_last: int
    resume: str
    async_: bool
    config_hash: str
    model_meta: dict[str, Any]
    parallel_meta: dict[str, Any]
    #: the gradient exchange's layout, checked on resume: [dp, tp, pp], [compression, ratio, warmup], buckets
    comm_layout: dict[str, Any]
    topk_state: bool  # ``parallel.grad_compression: topk``: the ranks' residuals are saved and restored
    lineage: LineageKey


@dataclass(frozen=True)
class ProcessSettings:
    """The worker process around the trainer: device, process group, logging, permission mode, system metrics."""

    task: str
    device: str
    deterministic: bool
    backend: str
    timeout_ms: int
    log_level: str
    json_log: str | None
    permission_mode: str
    audit_log: str | None
    tracking_uri: str | None
    system_metrics: bool
    system_metrics_interval_s: float


@dataclass(frozen=True)
class RunSettings:
    """Everything a worker's engine reads of its job, built by :func:`run_settings`."""

    process: ProcessSettings
    train: TrainSettings
    precision: PrecisionSettings
    build: ModelBuildSettings
    grad_sync: GradSyncSettings
    batches: BatchSettings
    checkpoint: CheckpointSettings
    evaluation: EvalSettings
    model: Any  # the ``model`` section, for the model layer
    data: Any  # the ``data`` section, for the data layer
    job: Any  # the validated JobConfig, for the whole-job reports only (kc plan's memory estimate)


def _no_eval_reason(data: Any) -> str:
    if data.is_synthetic and int(data.synthetic.num_eval) < 1:
        return "data.synthetic.num_eval is 0"
    if not data.is_synthetic and not data.eval_path:
        return f"data.path {data.path} has no held-out data: set data.eval_path"
    return ""


def run_settings(cfg: Any) -> RunSettings:
    """The settings of a training run, from a validated :class:`~kuangchao_core.config.schema.JobConfig`."""
    task, train, opt, par, ckpt, data = cfg.task, cfg.train, cfg.optimizer, cfg.parallel, cfg.checkpoint, cfg.data
    log, perm, tracking, ls = cfg.logging, cfg.permission, cfg.tracking, train.loss_scaling
    seed = int(task.seed)
    return RunSettings(
        process=ProcessSettings(
            task=task.name,
            device=train.device,
            deterministic=bool(train.deterministic),
            backend=par.backend,
            timeout_ms=int(par.timeout_ms),
            log_level=log.level,
            json_log=log.json_file,
            permission_mode=perm.mode,
            audit_log=perm.audit_log,
            tracking_uri=tracking.uri,
            system_metrics=bool(tracking.system_metrics),
            system_metrics_interval_s=float(tracking.system_metrics_interval_s),
        ),
        train=TrainSettings(
            seed=seed,
            steps=int(train.steps),
            warmup_steps=int(train.warmup_steps),
            lr=float(opt.lr),
            lr_schedule=train.lr_schedule,
            min_lr_ratio=float(train.min_lr_ratio),
            max_grad_norm=float(opt.max_grad_norm or 0.0),
            log_interval=max(1, int(train.log_interval)),
            eval_interval=int(train.eval_interval),
            max_bad_steps=int(train.max_bad_steps),
            anomaly=train.anomaly,
            pretrained=cfg.model.checkpoint,
        ),
        precision=PrecisionSettings(
            dtype=train.dtype,
            initial_scale=float(ls.initial_scale),
            growth_interval=int(ls.growth_interval),
            hysteresis=int(ls.hysteresis),
        ),
        build=ModelBuildSettings(
            seed=seed,
            dtype=train.dtype,
            param_dtype=train.param_dtype,
            activation_checkpointing=train.activation_checkpointing,
            compile=bool(train.compile),
            lora=cfg.model.lora,
            virtual_pipeline_size=int(par.virtual_pipeline_size),
            pipeline_schedule=par.pipeline_schedule,
            zero_stage=int(par.zero_stage),
            sequence_parallel=bool(par.sequence_parallel),
        ),
        grad_sync=GradSyncSettings(
            lr=float(opt.lr),
            betas=tuple(opt.betas),
            eps=float(opt.eps),
            weight_decay=float(opt.weight_decay),
            weight_decay_exclude=tuple(opt.weight_decay_exclude),
            zero_stage=int(par.zero_stage),
            bucket_size_mb=par.bucket_size_mb,
            grad_compression=par.grad_compression,
            grad_reduce_dtype=par.grad_reduce_dtype,
            topk_ratio=par.topk_ratio,
            topk_warmup_steps=par.topk_warmup_steps,
            param_dtype=train.param_dtype,
        ),
        batches=BatchSettings(
            micro_batch_size=int(par.micro_batch_size),
            gradient_accumulation_steps=int(par.gradient_accumulation_steps),
            shuffle=bool(data.shuffle),
            prefetch=int(data.prefetch),
            documents=data.packing == "documents",
            no_eval_reason=_no_eval_reason(data),
        ),
        checkpoint=CheckpointSettings(
            dir=ckpt.dir,
            task=task.name,
            seed=seed,
            pretrained=cfg.model.checkpoint,
            interval=int(ckpt.interval),
            keep_last=int(ckpt.keep_last),
            resume=ckpt.resume,
            async_=bool(ckpt.async_),
            config_hash=cfg.config_hash(),
            model_meta=cfg.model.model_dump(mode="json"),
            parallel_meta=par.model_dump(mode="json"),
            comm_layout={
                "sizes": [par.data_parallel_size, par.tensor_parallel_size, par.pipeline_parallel_size],
                "compression": [par.grad_compression, par.topk_ratio, par.topk_warmup_steps],
                "buckets": par.bucket_size_mb,
            },
            topk_state=par.grad_compression == "topk",
            lineage=lineage_key(cfg),
        ),
        evaluation=eval_settings(cfg),
        model=cfg.model,
        data=cfg.data,
        job=cfg,
    )

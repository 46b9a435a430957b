"""Settings a job accepts but does not use, said once at start (a config key is never silently ignored).

Each entry is ``(dotted path, why)``. Most are settings that only mean something together with another one
(``checkpoint.endpoint_url`` without ``checkpoint.uri``); a few are not built yet (placement by
priority) and say what the job does instead. A setting counts as *given* when the config file or an override
names it, so defaults never produce a warning.
"""

from __future__ import annotations

from typing import Any

Warnings = list[tuple[str, str]]

#: set in a worker's environment when the orchestrator has already reported the unused settings
UNUSED_REPORTED_ENV = "KC_UNUSED_SETTINGS_REPORTED"


def _given(section: Any, name: str) -> bool:
    return name in getattr(section, "model_fields_set", ())


def unused_settings(cfg: Any) -> Warnings:
    """Every setting of ``cfg`` (a validated JobConfig) this job will not use, with the reason."""
    out: Warnings = []
    train, par, data, perm, cluster, ckpt = (
        cfg.train,
        cfg.parallel,
        cfg.data,
        cfg.permission,
        cfg.cluster,
        cfg.checkpoint,
    )
    if train.dtype != "fp16" and _given(train, "loss_scaling"):
        out.append(("train.loss_scaling", f"only used with train.dtype fp16; this job trains in {train.dtype}"))
    zero_reduces_fp32 = par.zero_stage and train.param_dtype != "bf16"  # bf16 parameters: ZeRO sums as asked
    if par.grad_reduce_dtype != "fp32" and (zero_reduces_fp32 or par.grad_compression != "none"):
        why = (
            f"ZeRO-{par.zero_stage} reduce-scatters fp32 gradients"
            if par.zero_stage
            else f"grad_compression {par.grad_compression} decides the exchange"
        )
        out.append(("parallel.grad_reduce_dtype", f"applies to uncompressed DP buckets of zero_stage 0; {why}"))
    if train.lr_schedule == "constant" and _given(train, "min_lr_ratio"):
        out.append(("train.min_lr_ratio", "only used by lr_schedule cosine; this job's learning rate is constant"))
    if train.warmup_steps >= train.steps:
        out.append(
            (
                "train.warmup_steps",
                f"{train.warmup_steps} >= train.steps {train.steps}: the learning rate rises for the whole run and "
                "never reaches optimizer.lr",
            )
        )
    if cfg.task.priority != "normal" and cluster.mode != "dynamic":
        out.append(("task.priority", "only weighs the choice of nodes in a dynamic cluster (cluster.mode dynamic)"))
    if cluster.mode == "local" and _given(cluster, "placement"):
        out.append(
            ("cluster.placement", "only used with cluster.mode static or dynamic; this job runs on this machine")
        )
    if cluster.mode == "slurm" and _given(cluster, "placement"):
        out.append(("cluster.placement", "Slurm grants the nodes; ranks fill them in the rendezvous' order"))
    if cluster.mode == "slurm" and cluster.elastic:
        out.append(
            ("cluster.elastic", "not built for cluster.mode slurm yet: a failed attempt resubmits the same shape")
        )
    if par.grad_compression != "none" and par.zero_stage:
        out.append(
            (
                "parallel.grad_compression",
                f"applies to the DP gradient buckets of zero_stage 0; ZeRO-{par.zero_stage} reduce-scatters "
                "uncompressed",
            )
        )
    if cfg.tracking.register_model and not cfg.tracking.log_model:
        out.append(("tracking.register_model", "needs tracking.log_model true: no model is logged to register"))
    if train.compile and par.zero_stage == 3:
        out.append(("train.compile", "not applied under zero_stage 3, whose blocks gather their parameters eagerly"))
    if data.cache_dir and data.is_synthetic:
        out.append(("data.cache_dir", "caches data files (text or sft records); the synthetic corpus is generated"))
    if data.format != "sft" and not (data.is_synthetic and data.synthetic.instructions) and _given(data, "truncation"):
        out.append(("data.truncation", "only used with data.format sft (text is packed across documents)"))
    if par.grad_compression != "topk":
        for key in ("topk_ratio", "topk_warmup_steps"):
            if _given(par, key):
                out.append((f"parallel.{key}", "only used with grad_compression topk"))
    if par.zero_stage and par.hierarchical_allreduce == "on" and _given(par, "hierarchical_allreduce"):
        out.append(("parallel.hierarchical_allreduce", "applies to the DP gradient buckets of zero_stage 0"))
    if cluster.mode == "local" and cluster.registry:
        out.append(("cluster.registry", "only used with cluster.mode static or dynamic; this job runs on this machine"))
    if par.pipeline_parallel_size == 1 and _given(par, "pipeline_schedule"):
        out.append(("parallel.pipeline_schedule", "only used with pipeline_parallel_size > 1"))
    if ckpt.endpoint_url and not ckpt.uri:
        out.append(
            ("checkpoint.endpoint_url", "only used with checkpoint.uri (s3://bucket/prefix); nothing is mirrored")
        )
    if data.is_synthetic:
        if _given(data, "text_field"):
            out.append(("data.text_field", "not used by the synthetic corpus (it has no records with fields)"))
        if data.eval_path:
            out.append(("data.eval_path", "not used: the synthetic corpus holds out its own problems (num_eval)"))
    else:
        if _given(data, "synthetic"):
            out.append(("data.synthetic", f"not used: the job reads {data.path}"))
        if data.format == "txt" and _given(data, "text_field"):
            out.append(("data.text_field", "not used for plain-text files (only jsonl and parquet have fields)"))
    if cfg.tracking.prometheus_port is None:
        for name in ("prometheus_host", "prometheus_grace_s", "prometheus_pushgateway"):
            if _given(cfg.tracking, name):
                out.append((f"tracking.{name}", "not used: tracking.prometheus_port is null (no metrics endpoint)"))
    if _given(data, "images") and cfg.model.vision is None:
        out.append(("data.images", "not used: a text-only job (model.vision unset) reads no image records"))
    moe = cfg.model.moe
    if moe is not None and moe.balance != "bias" and _given(moe, "bias_update_rate"):
        out.append(("model.moe.bias_update_rate", "only used with model.moe.balance: bias"))
    if moe is not None and cfg.tracking.log_model and _given(cfg.tracking, "log_model"):
        out.append(("tracking.log_model", "a MoE model has no Hugging Face export yet: only its checkpoints are kept"))
    if perm.mode == "trusted":
        for name in ("token_ttl_seconds", "roles", "allowed_interfaces", "operators"):
            if _given(perm, name):
                out.append((f"permission.{name}", "not used in permission.mode trusted (no tokens are checked)"))
    return out

"""Checks that involve more than one config field. Each message shows the numbers involved.

``cross_checks`` takes whichever sections validated on their own, so a config with a type error in one section
still gets every cross-field problem of the others reported in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kuangchao_core import axes as table
from kuangchao_core.axes import MeshAxes
from kuangchao_core.config.cluster_schema import slurm_time_s
from kuangchao_core.config.moe_schema import moe_errors, moe_layout_errors
from kuangchao_core.config.slurm_options import export_env_errors
from kuangchao_core.config.train_schema import ANSWER_CASES, TEXT_NEW_TOKENS, TEXT_PROMPT_TOKENS
from kuangchao_core.config.vision_schema import vision_errors, vision_layout_errors

Errors = list[tuple[str, str]]
_CHECKS: list[tuple[tuple[str, ...], Callable[..., Errors]]] = []


def _check(*sections: str) -> Callable[[Callable[..., Errors]], Callable[..., Errors]]:
    def register(fn: Callable[..., Errors]) -> Callable[..., Errors]:
        _CHECKS.append((sections, fn))
        return fn

    return register


def cross_checks(sections: dict[str, Any]) -> Errors:
    """Run every check whose sections are all present; return ``(dotted_path, message)`` pairs."""
    errors: Errors = []
    for needed, fn in _CHECKS:
        if all(sections.get(name) is not None for name in needed):
            errors.extend(fn(*(sections[name] for name in needed)))
    return errors


@_check("model")
def _model_shape(model: Any) -> Errors:
    errors: Errors = []
    if model.hidden_size and model.num_heads:
        if model.hidden_size % model.num_heads:
            errors.append(
                (
                    "model.num_heads",
                    f"hidden_size {model.hidden_size} is not divisible by num_heads {model.num_heads}",
                )
            )
        elif (model.hidden_size // model.num_heads) % 2:
            errors.append(
                (
                    "model.num_heads",
                    f"head dimension hidden_size/num_heads = {model.hidden_size}/{model.num_heads} = "
                    f"{model.hidden_size // model.num_heads} must be even for rotary embeddings",
                )
            )
    if model.num_heads and model.num_kv_heads:
        if model.num_kv_heads > model.num_heads or model.num_heads % model.num_kv_heads:
            message = f"num_kv_heads {model.num_kv_heads} must divide num_heads {model.num_heads}"
            errors.append(("model.num_kv_heads", message))
    return errors


@_check("model")
def _vision(model: Any) -> Errors:
    if model.vision is None or model.checkpoint:  # unset fields come from the checkpoint: checked when resolved
        return []
    return vision_errors(model.vision, model.vocab_size)


@_check("model", "parallel")
def _vision_layout(model: Any, parallel: Any) -> Errors:
    if model.vision is None:
        return []
    errors = vision_layout_errors(model.vision, parallel.tensor_parallel_size)
    if model.checkpoint:  # the tower's sizes come from the checkpoint: the plan's check reads them (engine.plan_vision)
        errors = [(p, m) for p, m in errors if not p.endswith((".num_heads", ".intermediate_size"))]
    return errors


@_check("model", "parallel", "train", "tracking")
def _moe(model: Any, parallel: Any, train: Any, tracking: Any) -> Errors:
    if model.moe is None:
        return []
    return moe_errors(model.moe, model.num_layers) + moe_layout_errors(model, parallel, train, tracking)


@_check("model", "parallel")
def _model_vs_layout(model: Any, parallel: Any) -> Errors:
    errors: Errors = []
    tp = parallel.tensor_parallel_size
    if model.num_heads and model.num_heads % tp:
        errors.append(
            (
                "parallel.tensor_parallel_size",
                f"model.num_heads {model.num_heads} is not divisible by tensor_parallel_size {tp}",
            )
        )
    kv = model.num_kv_heads
    if kv and kv % tp and tp % kv:
        errors.append(
            (
                "parallel.tensor_parallel_size",
                f"model.num_kv_heads {kv} and tensor_parallel_size {tp}: one must divide the other "
                "(key/value heads are split across TP ranks, or replicated when there are fewer than ranks)",
            )
        )
    if model.intermediate_size and model.intermediate_size % tp:
        errors.append(
            (
                "parallel.tensor_parallel_size",
                f"model.intermediate_size {model.intermediate_size} is not divisible by tensor_parallel_size {tp}",
            )
        )
    pp, vpp = parallel.pipeline_parallel_size, parallel.virtual_pipeline_size
    if model.num_layers and model.num_layers % (pp * vpp):
        errors.append(
            (
                "parallel.pipeline_parallel_size",
                f"model.num_layers {model.num_layers} is not divisible by pipeline_parallel_size × "
                f"virtual_pipeline_size = {pp}×{vpp} = {pp * vpp}",
            )
        )
    return errors


@_check("parallel")
def _schedule(parallel: Any) -> Errors:
    errors: Errors = []
    pp, vpp = parallel.pipeline_parallel_size, parallel.virtual_pipeline_size
    accum = parallel.gradient_accumulation_steps
    if parallel.pipeline_schedule == "interleaved_1f1b":
        if vpp < 2:
            errors.append(
                (
                    "parallel.virtual_pipeline_size",
                    f"pipeline_schedule interleaved_1f1b needs virtual_pipeline_size > 1, got {vpp}",
                )
            )
        if pp < 2:
            errors.append(
                (
                    "parallel.pipeline_parallel_size",
                    f"pipeline_schedule interleaved_1f1b needs pipeline_parallel_size > 1, got {pp}",
                )
            )
        elif accum % pp:
            errors.append(
                (
                    "parallel.gradient_accumulation_steps",
                    f"interleaved_1f1b needs the micro-batch count (gradient_accumulation_steps {accum}) to be a "
                    f"multiple of pipeline_parallel_size {pp}",
                )
            )
    elif vpp > 1:
        errors.append(
            (
                "parallel.virtual_pipeline_size",
                f"virtual_pipeline_size {vpp} > 1 needs pipeline_schedule interleaved_1f1b, "
                f"got {parallel.pipeline_schedule}",
            )
        )
    return errors


@_check("parallel")
def _sequence_parallel(parallel: Any) -> Errors:
    if parallel.sequence_parallel and parallel.tensor_parallel_size < 2:
        return [
            (
                "parallel.sequence_parallel",
                f"sequence parallelism splits the sequence over the tensor-parallel group, but tensor_parallel_size "
                f"is {parallel.tensor_parallel_size}: set tensor_parallel_size > 1 or sequence_parallel false",
            )
        ]
    return []


@_check("data", "parallel")
def _sequence_splits(data: Any, parallel: Any) -> Errors:
    tp = parallel.tensor_parallel_size
    if parallel.sequence_parallel and tp > 1 and data.seq_len % tp:
        return [
            (
                "data.seq_len",
                f"seq_len {data.seq_len} is not divisible by tensor_parallel_size {tp} (parallel.sequence_parallel "
                "splits every sequence into tensor_parallel_size equal parts)",
            )
        ]
    return []


@_check("model", "parallel", "train")
def _axes(model: Any, parallel: Any, train: Any) -> Errors:
    """The table's own rules: an axis within another divides it, and each axis's ``Axis.checks``."""
    own = [e for a in table.TABLE if a.checks for e in table.resolve(a.checks)(model, parallel, train)]
    return table.within_problems(MeshAxes.from_parallel(parallel).sizes) + own


@_check("parallel", "cluster")
def _world_size(parallel: Any, cluster: Any) -> Errors:
    devices = cluster.devices
    if devices is None or devices == parallel.world_size:
        return []
    axes = MeshAxes.from_parallel(parallel)
    shown = [a for a in axes.shown() if a in table.GRID]  # built always, or > 1 rank; counted in the world size
    keys, sizes = " × ".join(table.SIZE_KEYS[a] for a in shown), "×".join(str(axes.sizes[a]) for a in shown)
    layout = f"world size {keys} = {sizes} = {axes.world_size}"
    if cluster.mode == "local":
        return [("parallel.data_parallel_size", f"{layout}, but cluster.nproc_per_node is {devices}")]
    if cluster.mode == "slurm":
        slurm = cluster.slurm
        provided = (
            f"cluster.slurm.nodes {slurm.nodes} × cluster.slurm.tasks_per_node {slurm.tasks_per_node} = {devices}"
        )
        return [("parallel.data_parallel_size", f"{layout}, but {provided}")]
    workers = cluster.worker_nodes
    if cluster.nproc_per_node is not None:
        provided = f"cluster.nproc_per_node {cluster.nproc_per_node} × {len(workers)} worker nodes = {devices}"
    else:
        provided = f"the cluster's worker nodes have {'+'.join(str(n.gpus) for n in workers) or '0'} = {devices} GPUs"
    return [("parallel.data_parallel_size", f"{layout}, but {provided}")]


def _slurm_shape(cluster: Any) -> Errors:
    """``cluster.slurm`` only with ``mode: slurm``, which needs it and counts its ranks there alone."""
    if cluster.mode != "slurm":
        return [("cluster.slurm", f"only used with mode slurm, not {cluster.mode}")] if cluster.slurm else []
    if cluster.slurm is None:
        return [("cluster.slurm", "mode slurm needs its settings (nodes, tasks_per_node, partition …)")]
    errors: Errors = []
    if cluster.nproc_per_node not in (None, cluster.slurm.tasks_per_node):
        errors.append(
            (
                "cluster.nproc_per_node",
                f"{cluster.nproc_per_node} differs from cluster.slurm.tasks_per_node {cluster.slurm.tasks_per_node}, "
                "the ranks per node of mode slurm",
            )
        )
    if cluster.registry:
        errors.append(("cluster.registry", "mode slurm takes its nodes from Slurm, not from a registry"))
    if cluster.slurm.switches_wait and cluster.slurm.switches is None:
        errors.append(("cluster.slurm.switches_wait", "only used with cluster.slurm.switches"))
    limit, before = slurm_time_s(cluster.slurm.time_limit), cluster.slurm.checkpoint_before_limit_s
    if limit is not None and before >= limit:
        errors.append(
            (
                "cluster.slurm.checkpoint_before_limit_s",
                f"{before} s is not less than cluster.slurm.time_limit {cluster.slurm.time_limit} ({limit} s): "
                "the checkpoint would be asked for at once (0: no signal)",
            )
        )
    return errors


@_check("cluster")
def _slurm_env(cluster: Any) -> Errors:
    """``cluster.slurm.export_env``: no credential-like name unless ``export_env_allow_secrets`` lists it."""
    return export_env_errors(cluster.slurm) if cluster.slurm is not None else []


@_check("cluster")
def _cluster_shape(cluster: Any) -> Errors:
    errors: Errors = []
    if cluster.mode == "static":
        if not cluster.nodes:
            errors.append(("cluster.nodes", "mode static needs at least one node"))
        elif not cluster.worker_nodes:
            errors.append(("cluster.nodes", "mode static needs at least one node with role worker"))
        for index, node in enumerate(cluster.nodes):
            if node.role == "worker" and node.gpus < 1 and cluster.nproc_per_node is None:
                errors.append((f"cluster.nodes.{index}.gpus", f"worker node {node.host} has {node.gpus} GPUs"))
            if cluster.nproc_per_node is not None and node.role == "worker" and 0 < node.gpus < cluster.nproc_per_node:
                errors.append(
                    (
                        f"cluster.nodes.{index}.gpus",
                        f"node {node.host} has {node.gpus} GPUs, fewer than cluster.nproc_per_node "
                        f"{cluster.nproc_per_node}",
                    )
                )
    elif cluster.nodes:
        errors.append(("cluster.nodes", f"nodes are only used with mode static, not {cluster.mode}"))
    if cluster.mode == "dynamic" and not cluster.registry:
        errors.append(("cluster.registry", "mode dynamic needs a registry address"))
    errors += _slurm_shape(cluster)
    timeout, interval = cluster.heartbeat_timeout_s, cluster.heartbeat_interval_s
    if timeout is not None and timeout <= 2 * interval:
        errors.append(
            (
                "cluster.heartbeat_timeout_s",
                f"heartbeat_timeout_s {timeout:g} must exceed twice heartbeat_interval_s {interval:g}",
            )
        )
    seen: dict[str, int] = {}
    for index, node in enumerate(cluster.nodes):
        if node.host in seen:
            errors.append(
                (f"cluster.nodes.{index}.host", f"host {node.host} is already listed as node {seen[node.host]}")
            )
        seen.setdefault(node.host, index)
    return errors


@_check("parallel", "train")
def _backend_device(parallel: Any, train: Any) -> Errors:
    if parallel.backend == "nccl" and train.device == "cpu":
        return [("parallel.backend", "backend nccl needs CUDA devices but train.device is cpu; use gloo or auto")]
    return []


@_check("train", "parallel")
def _param_dtype(train: Any, parallel: Any) -> Errors:
    """``train.param_dtype: bf16`` runs with bf16 autocast (norms, softmax and the loss in fp32) and the plain
    gradient exchange (issue 29 item 1)."""
    if train.param_dtype != "bf16":
        return []
    errors: Errors = []
    if train.dtype != "bf16":
        errors.append(
            ("train.param_dtype", f"bf16 parameters need train.dtype bf16 (their compute dtype), got {train.dtype}")
        )
    if parallel.grad_compression != "none":
        errors.append(
            (
                "train.param_dtype",
                f"bf16 parameters with parallel.grad_compression {parallel.grad_compression} are not supported; "
                "use grad_compression none (parallel.grad_reduce_dtype bf16 halves the bytes)",
            )
        )
    return errors


@_check("data", "model")
def _data_vs_model(data: Any, model: Any) -> Errors:
    errors: Errors = []
    if model.max_seq_len and data.seq_len > model.max_seq_len:
        errors.append(("data.seq_len", f"seq_len {data.seq_len} exceeds model.max_seq_len {model.max_seq_len}"))
    if data.tokenizer == "byte" and model.vocab_size and model.vocab_size < 256:
        errors.append(("model.vocab_size", f"the byte tokenizer needs vocab_size >= 256, got {model.vocab_size}"))
    return errors


@_check("train", "data", "model")
def _samples_fit(train: Any, data: Any, model: Any) -> Errors:
    """Greedy samples longer than ``model.max_seq_len``, where the config tells: a text sample's prompt is the first
    tokens of a held-out window; data with answers has prompts of one token at least (the records decide the rest,
    checked when the job's data is built: ``engine.samples.fitting_cases``)."""
    limit, samples = model.max_seq_len, train.samples
    answers = data.is_synthetic or data.format == "sft" or model.vision is not None
    count = samples.count if samples.count is not None else (ANSWER_CASES if answers else 0)
    if not limit or not count or (answers and samples.max_new_tokens is None) or model.vision is not None:
        return []
    prompt = 1 if answers else min(TEXT_PROMPT_TOKENS, data.seq_len)
    new = samples.max_new_tokens or TEXT_NEW_TOKENS
    need = prompt + new - 1  # the last new token is never fed back
    if need <= limit:
        return []
    what = "a prompt of at least 1 token" if answers else f"a prompt of {prompt} tokens"
    return [
        (
            "model.max_seq_len",
            f"{limit} positions cannot hold the evaluation's greedy samples ({what} and train.samples.max_new_tokens "
            f"{new}, the last never fed back): raise model.max_seq_len to at least {need}, lower "
            "train.samples.max_new_tokens, or set train.samples.count: 0",
        )
    ]


@_check("data")
def _data_source(data: Any) -> Errors:
    if data.path is None and data.format not in ("auto", "synthetic"):
        return [("data.path", f"data.format {data.format} needs a path; leave format auto for the synthetic corpus")]
    if data.path is not None and data.format == "synthetic":
        return [("data.path", f"data.format synthetic takes no path, got {data.path!r}")]
    instructions = data.is_synthetic and data.synthetic.instructions
    if data.packing == "none" and data.format != "sft" and not instructions:
        return [("data.packing", "none (one example per row) applies to data.format sft; text is packed with concat")]
    return []


@_check("data", "parallel")
def _enough_samples(data: Any, parallel: Any) -> Errors:
    if not data.is_synthetic:
        return []
    needed = parallel.global_batch_size
    have = data.synthetic.num_train
    if have < needed:
        return [
            (
                "data.synthetic.num_train",
                f"{have} samples are fewer than one global batch: micro_batch_size × gradient_accumulation_steps × "
                f"data_parallel_size = {parallel.micro_batch_size}×{parallel.gradient_accumulation_steps}×"
                f"{parallel.data_parallel_size} = {needed}",
            )
        ]
    return []

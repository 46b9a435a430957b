"""Checkpoint conversion: write a step directory again in another layout, or export it as a Hugging Face model.

Both read through :class:`~kuangchao_core.ckpt.index.CheckpointIndex` (any layout: TP/PP/DP/ZeRO shards) and write
safetensors and JSON only, never pickle; both are atomic (manifest last / ``os.replace``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from kuangchao_core.ckpt.hf import write_hf_dir
from kuangchao_core.ckpt.index import (
    OPTIM,
    PARAM,
    CheckpointIndex,
    load_for_layout,
    load_optimizer_for_layout,
    model_config_of_checkpoint,
    param_keys,
)
from kuangchao_core.ckpt.layout import TENSOR_TABLE, step_dir_name
from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.layout import TargetLayout

__all__ = ["export_hf", "relayout_checkpoint"]


def relayout_checkpoint(
    src_step_dir: str | os.PathLike[str],
    dst_task_dir: str | os.PathLike[str],
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    virtual: int = 1,
) -> Path:
    """Write ``src_step_dir`` again under ``dst_task_dir/step_<N>`` laid out for dp x tp x pp (same format).

    Each new rank's shard holds its parameters' slices and their optimizer state cut the same way (DP replicas
    each hold a copy, ZeRO ranges become unsharded). ``state.json`` is copied (``parallel`` in the manifest is
    updated, ``zero_stage`` 0); new rank ``r`` gets the RNG file of old rank ``r`` (rank 0's when there is none).
    The writer's protocol runs with one thread per new rank, so the manifest is written last and the step
    directory appears atomically. Returns the new step directory.
    """
    from kuangchao_core.ckpt.reader import read_rng, read_state
    from kuangchao_core.ckpt.writer import CheckpointWriter
    from kuangchao_core.parallel.mesh import mesh_layout

    src = Path(src_step_dir)
    index = CheckpointIndex.open(src)
    manifest = index.manifest
    index.close()
    if manifest.get("lora") is not None:
        raise CheckpointError(
            f"{src} holds LoRA adapters, which resume in any layout as they are; export them with --format peft, "
            "or merged into the base with --format hf"
        )
    cfg = model_config_of_checkpoint(manifest)
    layout = mesh_layout({"dp": dp, "tp": tp, "pp": pp})
    world = layout.world_size
    state = read_state(src)
    step = int(state.get("step", manifest.get("step")))
    old_world = int(manifest["world_size"])
    parallel = dict(manifest.get("parallel") or {})
    parallel.update(
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        virtual_pipeline_size=virtual,
        zero_stage=0,
    )
    reserved = {"format_version", "step", "kuangchao_version", "torch_version", "created_at", "world_size"}
    meta = {k: v for k, v in manifest.items() if k not in reserved | {"files", "tensors", TENSOR_TABLE}}
    meta["parallel"] = parallel
    meta["converted_from"] = {"path": str(src), "world_size": old_world, "parallel": manifest.get("parallel")}
    dst = Path(dst_task_dir)
    barrier = threading.Barrier(world, timeout=600)
    errors: list[BaseException] = []

    def save(rank: int) -> None:
        try:
            at = layout.coords_of(rank)
            tp_rank, pp_rank = at["tp"], at["pp"]
            slices = TargetLayout(tp, pp, tp_rank, pp_rank, virtual).param_slices(cfg)
            tensors = load_for_layout(src, param_keys(slices))
            optim = load_optimizer_for_layout(src, slices)
            tensors.update(optim)
            spec = {k: r.to_meta() for k, r in param_keys(slices).items()}
            for key in optim:
                name = key[len(OPTIM) :].rsplit(".", 1)[0]
                if tuple(optim[key].shape) == tuple(slices[name].shape) and optim[key].dim():
                    spec[key] = slices[name].to_meta()
            writer = CheckpointWriter(dst.parent, dst.name, rank, world, barrier.wait, attempt_id=f"convert-{step}")
            writer.save(
                step,
                tensors,
                rng_state=read_rng(src, rank if rank < old_world else 0),
                state=state,
                meta=meta,
                slices=spec,
            )
        except BaseException as exc:  # reported after join; abort the barrier so peers do not wait forever
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=save, args=(r,), name=f"convert-rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    return dst / step_dir_name(step)


def export_hf(step_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "fp32") -> Path:
    """Write ``out_dir/model.safetensors`` (full parameters in ``dtype``, HF names) and ``out_dir/config.json``.
    The source is the checkpoint's fp32 parameters — a ``train.param_dtype: bf16`` job's fp32 master weights.

    Reads any layout (TP/PP/DP/ZeRO shards, experts sharded over ep). A MoE model is written as a Mixtral
    (:mod:`kuangchao_core.ckpt.hf_moe`; refused, naming the field, when its block is not Mixtral's). Returns
    ``out_dir``. A LoRA checkpoint (adapters only) is merged into
    its base by :func:`~kuangchao_core.ckpt.lora_export.export_merged` instead.
    """
    index = CheckpointIndex.open(step_dir)
    try:
        if index.manifest.get("lora") is not None:
            raise CheckpointError(f"{step_dir} holds LoRA adapters only: merge them into their base (export_merged)")
        cfg = model_config_of_checkpoint(index.manifest)
        if (index.manifest.get("model") or {}).get("vision") is not None:
            from kuangchao_core.ckpt.vlm_export import export_hf_llava

            params = {k[len(PARAM) :]: index.read(k).to(torch.float32) for k in index.keys() if k.startswith(PARAM)}
            return export_hf_llava(params, index.manifest, cfg, out_dir, dtype)
        tensors = {
            key[len(PARAM) :]: index.read(key).to(torch.float32).contiguous()
            for key in index.keys()
            if key.startswith(PARAM)
        }
    finally:
        index.close()
    from kuangchao_core.models.tp_llama import full_shapes

    expected = full_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{step_dir}: parameters missing from the checkpoint: {missing[:5]}")
    return write_hf_dir(tensors, cfg, out_dir, dtype)

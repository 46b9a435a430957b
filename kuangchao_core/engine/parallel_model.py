"""Build this rank's part of the model for a dp×cp×pp×tp mesh: TP layers, pipeline chunks, ring attention under
context parallelism, and what it holds.

The model is initialised exactly as the one-process model with the same seed (TP layers draw the full tensor and
keep their slice), then the layers of other pipeline stages are dropped, so every layout trains the same network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kuangchao_core import axes as table
from kuangchao_core.config.settings import ModelBuildSettings
from kuangchao_core.errors import PlanError
from kuangchao_core.hal.dtypes import param_dtype
from kuangchao_core.models.compile import compile_layers
from kuangchao_core.models.layout import Region, TargetLayout
from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss
from kuangchao_core.models.lora import LoraSettings, attach_lora, lora_regions
from kuangchao_core.models.moe import MoeStep, moe_step
from kuangchao_core.models.ring_attention import cp_attention, use_attention
from kuangchao_core.models.tp_llama import TPLlamaForCausalLM, init_from_seed
from kuangchao_core.obs.jsonlog import log_event
from kuangchao_core.parallel.forward_backward import get_forward_backward
from kuangchao_core.parallel.partial_sums import step_partial_sums
from kuangchao_core.parallel.pipeline import PipelineExecutor, build_stage_chunks
from kuangchao_core.parallel.placement import PlacementRecord

log = logging.getLogger("kuangchao.engine")


@dataclass
class ParallelModel:
    """This rank's model part and how to run it.

    ``model``: the (pruned) module whose parameters this rank trains; ``loss_fn(logits, labels)``;
    ``executor``: the pipeline executor when pp > 1; ``regions``: parameter name -> the region of the full
    tensor it holds; ``placement``: where each parameter lives on the mesh
    (:class:`~kuangchao_core.parallel.placement.PlacementRecord`) and ``groups`` its axes' groups; ``lora``: the adapters' settings when the base is frozen
    and only adapters train (``model.lora``); ``cp_attention``: the ring attention every layer calls under
    context parallelism (None at cp 1); ``moe``: the step's work for the MoE blocks (None without any).
    """

    model: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    executor: PipelineExecutor | None
    regions: dict[str, Region]
    placement: PlacementRecord
    groups: dict[str, Any]
    lora: LoraSettings | None = None
    cp_attention: Callable | None = None
    moe: MoeStep | None = None

    def trainable(self) -> set[str]:
        """Names of the parameters the optimizer updates and checkpoints hold."""
        return {n for n, p in self.model.named_parameters() if p.requires_grad}

    def step_function(self, precision: Any = None):
        """The step's forward and backward (:func:`~kuangchao_core.parallel.forward_backward.get_forward_backward`),
        with the partial sums :attr:`placement` records (:mod:`~kuangchao_core.parallel.partial_sums`) and the MoE
        blocks' auxiliary losses (:mod:`~kuangchao_core.models.moe`)."""
        sums = step_partial_sums(self.model, self.placement, self.groups)
        aux = self.moe.micro_batch_loss if self.moe is not None else None
        return get_forward_backward(self.model, self.loss_fn, self.executor, precision, sums, aux)

    def after_step(self, applied: bool, loads: torch.Tensor | None = None) -> None:
        """After the optimizer step (``applied``: not skipped): the MoE blocks' bias update (``balance: bias``), from
        the step's ``loads`` summed over every rank (``MoeStep.step_loads``; the trainer's ``step_values``)."""
        if self.moe is not None:
            self.moe.after_step(applied, loads)

    def extra_state(self) -> dict[str, Any]:
        """``state.json`` entries beside the parameters: the MoE routing biases (:meth:`MoeStep.state_dict`)."""
        return self.moe.state_dict() if self.moe is not None else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` wrote, from a checkpoint's ``state.json``."""
        if self.moe is not None:
            self.moe.load_state_dict(state)


def target_layout(mesh: Any, build: ModelBuildSettings) -> TargetLayout:
    """The checkpoint-resharding view of this rank's place in the mesh."""
    return TargetLayout(
        tp=mesh.tp, pp=mesh.pp, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank, virtual=build.virtual_pipeline_size
    )


def _prune_to_stage(model: LlamaForCausalLM, owned: set[str]) -> None:
    """Drop the layers, embedding, norm and head that other pipeline stages hold (their memory is freed)."""
    layers = model.model.layers
    for i in range(len(layers)):
        if not any(n.startswith(f"model.layers.{i}.") for n in owned):
            layers[i] = nn.Identity()
    if "model.embed_tokens.weight" not in owned:
        model.model.embed_tokens = None
    if "model.norm.weight" not in owned:
        model.model.norm = None
    if "lm_head.weight" not in owned:
        model.lm_head = None


def build_parallel_model(
    build: ModelBuildSettings, llama_cfg: LlamaConfig, mesh: Any, device: torch.device
) -> ParallelModel:
    """Build, initialise (seed ``task.seed``) and partition the model for this rank of ``mesh``; its parameters are
    in the dtype ``train.dtype`` names (initialised in fp32 in every case, so an fp64 job starts from the same
    values as an fp32 one); with ``train.param_dtype: bf16`` they stay fp32 until the job's GradSync has taken
    them as its master weights (:mod:`~kuangchao_core.parallel.precision_policy`)."""
    seed = build.seed
    sp = build.sequence_parallel and mesh.tp > 1
    if mesh.tp > 1:
        model: LlamaForCausalLM = TPLlamaForCausalLM(llama_cfg, mesh.tp_group, sequence_parallel=sp)
        init_from_seed(model, seed)
        loss_fn = model.loss
        if sp and mesh.rank == 0:
            log_event(log, "sequence parallel on", tp=mesh.tp, positions_per_rank=f"seq_len/{mesh.tp}")
    else:
        model = LlamaForCausalLM(llama_cfg)
        model.init_weights(seed)
        loss_fn = causal_lm_loss
    model.activation_checkpointing = build.activation_checkpointing
    cp_attend = None
    if getattr(mesh, "cp", 1) > 1:  # every attention layer runs the CP ring on this rank's shard of each sequence
        cp_attend = cp_attention(mesh.cp_group)
        use_attention(model, cp_attend)
    dtype = param_dtype(build.dtype)
    layout = target_layout(mesh, build)
    lora = LoraSettings.from_config(build.lora)
    if lora is not None:  # on every layer before the pipeline prunes: the adapters' draws do not depend on pp
        whole = TargetLayout(mesh.tp, 1, mesh.tp_rank, 0, 1).param_slices(llama_cfg)
        attach_lora(model, lora, whole, seed)
    regions = _with_adapters(layout.param_slices(llama_cfg), lora)
    executor = None
    if mesh.pp > 1:
        chunks = build_stage_chunks(model, mesh.pp, mesh.pp_rank, build.virtual_pipeline_size)
        _prune_to_stage(model, set(regions))
        model = model.to(device=device, dtype=dtype)
        executor = PipelineExecutor(
            mesh.pp_group,
            chunks,
            loss_fn,
            llama_cfg.hidden_size,
            schedule=build.pipeline_schedule,
            device=device,
            dtype=torch.bfloat16 if build.param_dtype == "bf16" else dtype,  # bf16 parameters: bf16 activations
            seq_shards=mesh.tp if sp else 1,  # sequence parallelism: stages exchange s/tp positions
        )
    else:
        model = model.to(device=device, dtype=dtype)
    if build.compile and build.zero_stage != 3:  # ZeRO-3 wraps each block's forward to gather it
        if getattr(model, "regather", None) is not None:
            model.regather.enabled = False  # saved-tensor hooks around compiled layers are not verified
        compile_layers(model, report=mesh.rank == 0)  # rank 0 logs the compile time once
    names = {n for n, _ in model.named_parameters()}
    if names != set(regions):
        raise PlanError(
            [("parallel", f"rank {mesh.rank}: parameters {sorted(names ^ set(regions))[:4]} do not match the layout")]
        )
    sizes = {axis: getattr(mesh, axis, 1) for axis in table.AXES}
    # whole on every TP rank but computed in part (their layers sum them in backward): LoRA's A, and under sequence
    # parallelism the norms and a row-parallel projection's B
    summed = {n for n in regions if n.endswith("lora_A.weight") or sp and n.endswith(("norm.weight", "lora_B.weight"))}
    placement = PlacementRecord.of_regions(regions, sizes, summed)
    for axis in (a for a in table.TABLE if a.place and sizes[a.name] > 1):  # parameters an axis places (experts)
        table.resolve(axis.place)(model, regions, placement, mesh)
    groups = {axis: getattr(mesh, f"{axis}_group", None) for axis in sizes}
    moe = moe_step(model, llama_cfg.moe, llama_cfg.num_layers) if llama_cfg.moe is not None else None
    return ParallelModel(model, loss_fn, executor, regions, placement, groups, lora, cp_attend, moe)


def _with_adapters(regions: dict[str, Region], lora: LoraSettings | None) -> dict[str, Region]:
    return regions if lora is None else {**regions, **lora_regions(regions, lora)}

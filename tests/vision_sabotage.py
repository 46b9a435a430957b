"""Negative controls of the vision encoder's layouts (tests/test_vlm_engine.py), merged into
``tests.engine_helpers.SABOTAGE``: each breaks one reduction (or the pipelined greedy answers) of a built Trainer the
way a real bug would."""

from __future__ import annotations


def _encoder_reduced_over_dp_only(trainer):
    """``parallel: data`` beside decoder TP: the encoder's gradients are not summed over the TP group (the placement
    record forgets that each rank's share of the images gives a partial sum)."""
    from kuangchao_core.parallel.placement import Replicate

    for axes in trainer.parts.placement.params.values():  # a later pipeline stage holds no encoder: nothing to break
        if "vshare" in axes:
            axes["vshare"] = Replicate()


def _encoder_out_proj_unreduced(trainer):
    """``parallel: tp``: layer 0's row-parallel ``out_proj`` keeps its partial sum (its all-reduce is lost)."""
    import torch.nn.functional as F

    if not hasattr(trainer.model, "vision_tower"):  # a later pipeline stage: no encoder to break
        return
    layer = trainer.model.vision_tower.encoder.layers[0].self_attn.out_proj
    assert layer.tp > 1, "the control needs a split out_proj"
    layer.forward = lambda x, _w=layer.weight, _b=layer.bias: F.linear(x, _w) + _b


def _greedy_token_from_first_stage(trainer):
    """The greedy answers through the pipeline take each next token from the first stage (which has no logits: its
    placeholder zeros) instead of the last stage's choice. Every rank still agrees, so decoding stays in step.
    Training is untouched; the control stays on for the final evaluation."""
    from types import SimpleNamespace

    nxt = trainer.samples.next_tokens
    ex = nxt.executor
    # the source of the broadcast is the rank of stage ``num_stages - 1``: 1 makes it the first stage's
    nxt.executor = SimpleNamespace(forward_only=ex.forward_only, group=ex.group, num_stages=1, p=ex.p)


SABOTAGE = {
    "encoder_reduced_over_dp_only": _encoder_reduced_over_dp_only,
    "encoder_out_proj_unreduced": _encoder_out_proj_unreduced,
    "greedy_token_from_first_stage": _greedy_token_from_first_stage,
}

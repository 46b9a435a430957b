"""Negative controls of context parallelism in the engine (issue 30) and of the step's token count (issue 39): each
breaks one piece of a built Trainer the way a real bug would and returns how to undo it (``engine_helpers.SABOTAGE``
lists them)."""

from __future__ import annotations


def local_rotary_positions(trainer):
    """Every CP rank rotates its shard with positions 0..s/cp-1 (the shard's local positions, not the tokens' global
    ones)."""
    import torch

    from kuangchao_core.engine import trainer as trainer_module

    real = trainer_module.shard_micro_batches

    def local(batches, mesh):
        out = real(batches, mesh)
        for b in out:
            b["position_ids"] = torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"])
        return out

    trainer_module.shard_micro_batches = local

    def undo():
        trainer_module.shard_micro_batches = real

    return undo


def local_token_count(trainer):
    """The loss denominator is this rank's own labelled-token count (not the global batch's, summed over dp×cp)."""
    from kuangchao_core.engine import trainer as trainer_module

    real = trainer_module.step_loss_weight
    trainer_module.step_loss_weight = lambda batches, group, device, known=None: (
        real(batches, None, device) * group.size
    )

    def undo():
        trainer_module.step_loss_weight = real

    return undo


def own_count_for_every_rank(trainer):
    """The loader's count of the step's labelled tokens takes every dp rank's windows to hold as many as this rank's
    (the count the step normalises by without communication, issue 39)."""
    from kuangchao_core.data import loader as loader_module

    real = loader_module.PrefetchLoader._prepare

    def prepare(self):
        batches, state = real(self)
        if batches.labelled_per_rank is not None:
            mine = batches.labelled_per_rank[self.sampler.dp_rank]
            batches.labelled_per_rank = (mine,) * len(batches.labelled_per_rank)
        return batches, state

    loader_module.PrefetchLoader._prepare = prepare

    def undo():
        loader_module.PrefetchLoader._prepare = real

    return undo


def ring_without_documents(trainer):
    """Packed documents: the ring attends across document boundaries (the shards' document ids are dropped)."""
    from kuangchao_core.models.ring_attention import use_attention

    ring = trainer.parts.cp_attention
    use_attention(trainer.model, lambda q, k, v, documents=None: ring(q, k, v, None))


def fresh_optimizer_on_resume(trainer):
    """A resumed run keeps its fresh AdamW moments (the checkpoint's optimizer state is not loaded)."""
    trainer.sync.load_state = lambda optim, steps: None


SABOTAGE = {
    "fresh_optimizer_on_resume": fresh_optimizer_on_resume,
    "local_rotary_positions": local_rotary_positions,
    "local_token_count": local_token_count,
    "own_count_for_every_rank": own_count_for_every_rank,
    "ring_without_documents": ring_without_documents,
}

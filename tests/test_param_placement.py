"""The placement record (issue 43): where every parameter lives on the mesh, and the one place that reads it to
decide the gradient reductions beyond GradSync's average over the replicas.

- The clipping weights the record gives equal, for every parameter of a TP layout with replicated key/value heads
  and LoRA adapters, 1 / the number of TP ranks holding the same region (counted here by comparing every rank's
  regions, the rule the record replaced).
- The replica axes are dp and cp for every parameter; a parameter averaged over fewer is refused.
- :class:`~kuangchao_core.parallel.partial_sums.PartialSums` sums exactly the trainable parameters recorded as a
  partial sum outside the backward, over axes of more than one rank.
- No mechanism the record replaced is left in ``kuangchao_core/`` and one module of ``parallel/`` all-reduces
  parameter gradients outside GradSync's family (its detector bites on the replaced ``_sum_grads``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kuangchao_core.errors import PlanError
from kuangchao_core.models.layout import Region, TargetLayout
from kuangchao_core.models.llama import LlamaConfig
from kuangchao_core.models.lora import LoraSettings, lora_regions
from kuangchao_core.parallel.partial_sums import PartialSums
from kuangchao_core.parallel.placement import Partial, PlacementRecord, Replicate, Shard, tensor_axis

CORE = Path(__file__).resolve().parents[1] / "kuangchao_core"
CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
LORA = LoraSettings(rank=2, alpha=4.0, dropout=0.0, targets=("q_proj", "k_proj", "o_proj"))
#: the names of the replaced mechanisms: ReplicaMesh's dp×cp view, the VLM's own step and its encoder sum, the
#: peers' regions compared for the norm weights
OLD = (
    "ReplicaMesh",
    "def replicas(",
    "_sum_grads",
    "reduce_over_tp",
    "vision_forward_backward",
    "def _pipelined(executor",
)
OLD_RE = (r"def _micro_batches\(parts", r"for pr in peers", r"\bnorm_weight\[n\]\s*=")
#: GradSync's family: the reduction over the replicas and the global norm
GRADSYNC = {"data.py", "zero.py", "zero3.py", "grad_sync.py", "bucket_reduce.py"}


def _regions(tp: int, rank: int) -> dict[str, Region]:
    base = TargetLayout(tp, 1, rank, 0, 1).param_slices(CFG)
    return {**base, **lora_regions(base, LORA)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_norm_weights_count_each_element_once(tp):
    everyone = [_regions(tp, r) for r in range(tp)]
    for rank in range(tp):
        record = PlacementRecord.of_regions(everyone[rank], {"dp": 2, "cp": 1, "pp": 1, "tp": tp})
        peers = {n: 1.0 / sum(1 for other in everyone if other[n] == reg) for n, reg in everyone[rank].items()}
        assert record.norm_weight() == peers
    if tp == 4:  # two key/value heads over four ranks: k_proj in two slices, each held by two ranks
        assert record.params["model.layers.0.self_attn.k_proj.weight"]["tp"] == Shard(0, 2)
        assert record.norm_weight()["model.layers.0.self_attn.k_proj.weight"] == 0.5


def test_axes_of_a_parameter():
    split = Region.split((8, 4), 1, 2, 2)
    assert tensor_axis(split, 2) == Shard(1, 2)
    assert tensor_axis(Region.full((8,)), 2) == Replicate()
    assert tensor_axis(Region.full((8,)), 2, partial=True) == Partial("sum")
    assert tensor_axis(Region.full((8,)), 1, partial=True) == Replicate()  # one rank holds no partial sum
    record = PlacementRecord.of_regions({"w": split}, {"dp": 2, "cp": 2, "pp": 3, "tp": 2}, in_backward={"w"})
    assert record.params["w"] == {"dp": Partial("avg"), "cp": Partial("avg"), "pp": Shard(None, 3), "tp": Shard(1, 2)}
    assert record.replica_axes() == ("dp", "cp")


def test_sequence_parallel_norms_are_partial_sums_summed_in_backward():
    record = PlacementRecord.of_regions(
        {"norm.weight": Region.full((8,))}, {"dp": 1, "pp": 1, "tp": 2}, ["norm.weight"]
    )
    assert record.params["norm.weight"]["tp"] == Partial("sum", in_backward=True)
    assert record.norm_weight() == {"norm.weight": 0.5}


def test_parameters_averaged_over_different_axes_are_refused():
    record = PlacementRecord.of_regions({"a": Region.full((2,)), "b": Region.full((2,))}, {"dp": 2, "cp": 2, "tp": 1})
    del record.params["b"]["cp"]
    with pytest.raises(PlanError, match="averaged over different axes"):
        record.replica_axes()


def test_partial_sums_pick_the_trainable_step_time_partials():
    model = torch.nn.ModuleDict({n: torch.nn.Linear(2, 2, bias=False) for n in ("enc", "norm", "frozen", "body")})
    model["frozen"].weight.requires_grad_(False)
    record = PlacementRecord({"dp": 2, "vshare": 2, "tp": 2, "one": 1})
    stage = {"dp": Partial("avg")}
    record.params = {
        "enc.weight": {**stage, "vshare": Partial()},
        "norm.weight": {**stage, "tp": Partial("sum", in_backward=True)},
        "frozen.weight": {**stage, "vshare": Partial()},
        "body.weight": {**stage, "tp": Shard(0, 2), "one": Partial()},
    }
    assert PartialSums(model, record, {}).sums() == {"vshare": ["enc.weight"]}
    record.params["enc.weight"]["vshare"] = Replicate()  # what the VLM's negative control does
    assert PartialSums(model, record, {}).sums() == {}


def _reduces_param_grads(text: str) -> bool:
    return "all_reduce" in text and re.search(r"\.grad\b", text) is not None


def test_no_replaced_mechanism_is_left_and_one_module_decides_the_extra_reductions():
    sources = {p: p.read_text() for p in CORE.rglob("*.py")}
    left = [(str(p.relative_to(CORE)), old) for p, text in sources.items() for old in OLD if old in text]
    left += [(str(p.relative_to(CORE)), rx) for p, text in sources.items() for rx in OLD_RE if re.search(rx, text)]
    assert left == []
    deciders = sorted(
        str(p.relative_to(CORE)) for p, text in sources.items() if _reduces_param_grads(text) and p.name not in GRADSYNC
    )
    assert deciders == ["parallel/partial_sums.py"]
    # the detector bites: the VLM's replaced after-backward sum
    assert _reduces_param_grads("grads = [p.grad for p in params]\nP.all_reduce(flat, group=group, op='sum')")

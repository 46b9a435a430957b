"""The mesh generic for real (issue 43 item 3): an axis added in the test itself, through ``axes.extra_axis``,
without touching ``kuangchao_core/``, gets its groups (the mesh's build list and the tokens' grants), its
validation message by field path, its ``kc plan`` lines and its placement on every parameter; outside the block
the same axis is refused everywhere (the negative control).
"""

from __future__ import annotations

import pytest

from kuangchao_core import axes as table
from kuangchao_core.axes import Axis, MeshAxes, extra_axis, validated
from kuangchao_core.config import config_from_dict
from kuangchao_core.engine.plan import check_plan, explain_plan, format_plan
from kuangchao_core.errors import ConfigError, PlanError
from kuangchao_core.models.layout import Region
from kuangchao_core.parallel.mesh import MeshLayout, mesh_group_lists
from kuangchao_core.parallel.placement import Partial, PlacementRecord, Replicate, Shard
from kuangchao_core.perm.layout import group_layout, groups_of_rank

#: a throw-away axis between pp and tp: ranks that hold the same parameters and see the same tokens
XA = Axis("xa", "example_parallel_size")
#: a throw-away data axis: its ranks see different tokens, so gradients are averaged over it
XD = Axis("xd", "example_data_parallel_size", data=True)


def _cfg(**parallel):
    return config_from_dict(
        {
            "task": {"name": "extra-axis"},
            "model": {"preset": "tiny", "num_layers": 2},
            "data": {"format": "synthetic", "seq_len": 32},
            "parallel": parallel,
        }
    )


def test_an_added_axis_gets_its_groups_where_the_mesh_and_the_tokens_list_them():
    with extra_axis(XA, outside="tp"):
        assert table.AXES == ("dp", "cp", "pp", "xa", "tp", "ep")
        assert table.BUILD_ORDER == (
            "tp",
            "pp",
            "dp",
            "ep",
            "xa",
            "cp",
            "dp_cp",
            "dp_mod_ep",
        )  # added axes after the original three
        layout = MeshLayout(dp=2, xa=2, tp=2)
        assert layout.xa == 2 and layout.world_size == 8
        # rank = (dp * xa + xa_idx) * tp + tp_idx, written out here
        assert layout.groups("xa") == [[0, 2], [1, 3], [4, 6], [5, 7]]
        assert layout.coords_of(6) == {"dp": 1, "cp": 0, "pp": 0, "xa": 1, "tp": 0}
        assert layout.kinds() == ("tp", "pp", "dp", "xa")  # cp and dp_cp not built at cp 1
        built = mesh_group_lists(layout)  # exactly the list ParallelMesh builds, in its collective order
        assert [k for k, _ in built][-4:] == ["xa"] * 4 and ("xa", [4, 6]) in built  # after tp, pp, dp
        assert layout.describe()["xa_groups"] == {"xa0": [0, 2], "xa1": [1, 3], "xa2": [4, 6], "xa3": [5, 7]}
        tokens = group_layout({"dp": 2, "xa": 2, "tp": 2})
        assert "xa[4,6]" in groups_of_rank(tokens, 6) and "xa[0,2]" not in groups_of_rank(tokens, 6)
        # at one rank an added axis builds nothing, so a job without it is unchanged
        assert MeshLayout(dp=2, tp=2).kinds() == ("tp", "pp", "dp")
        assert not any(n.startswith("xa") for n in group_layout({"dp": 2, "tp": 2}))


def test_an_added_axis_is_validated_by_its_config_field():
    with extra_axis(XA, outside="tp"):
        with pytest.raises(PlanError) as info:
            validated({"dp": 2, "xa": 0})
        assert info.value.errors == [("parallel.example_parallel_size", "must be an integer >= 1, got 0")]
        assert ("parallel.example_parallel_size", "must be an integer >= 1, got 0") in check_plan(
            _cfg(example_parallel_size=0)
        )
        cfg = _cfg(data_parallel_size=2, tensor_parallel_size=2, example_parallel_size=2)
        assert cfg.parallel.world_size == 8 and cfg.parallel.example_parallel_size == 2
        again = config_from_dict(cfg.model_dump())  # the size travels with the config a worker receives
        assert again.parallel.example_parallel_size == 2
        errors = dict(check_plan(cfg, world_size=4))
        assert errors["parallel"].startswith(
            "data_parallel_size 2 x tensor_parallel_size 2 x example_parallel_size 2 x pipeline_parallel_size 1 = 8"
            " processes, but the world size is 4"
        ), errors
        assert check_plan(cfg, world_size=8) == []
        with pytest.raises(ConfigError) as info:  # the config's own check of the cluster's processes
            config_from_dict({**cfg.model_dump(), "cluster": {"mode": "local", "nproc_per_node": 4}})
        assert any("example_parallel_size" in m and "= 2×2×2×1 = 8" in m for _, m in info.value.errors), info.value


def test_an_added_axis_gets_its_plan_lines():
    with extra_axis(XA, outside="tp"):
        plan = explain_plan(_cfg(data_parallel_size=2, tensor_parallel_size=2, example_parallel_size=2))
    assert plan["sizes"]["xa"] == 2 and plan["sizes"]["world_size"] == 8
    assert plan["groups"]["xa_groups"] == {"xa0": [0, 2], "xa1": [1, 3], "xa2": [4, 6], "xa3": [5, 7]}
    assert plan["ranks"][6]["coords"] == {"dp": 1, "tp": 0, "xa": 1, "pp": 0}
    mine = [c["name"] for c in plan["communicators"]["ranks"][6]["communicators"]]
    assert "xa[4,6]" in mine and "xa[0,2]" not in mine  # the communicators rank 6 creates, its xa group among them
    with extra_axis(XA, outside="tp"):
        text = format_plan(plan)
    assert "layout: dp=2 x tp=2 x xa=2 x pp=1 (virtual 1) = 8 processes" in text, text
    assert "XA groups: xa0=[0, 2]  xa1=[1, 3]  xa2=[4, 6]  xa3=[5, 7]" in text, text


def test_an_added_axis_gets_a_placement_on_every_parameter():
    whole, cut = Region.full((4, 4)), Region.split((4, 4), 0, 0, 2)
    before = PlacementRecord.of_regions({"w": whole, "c": cut}, {"dp": 2, "pp": 1, "tp": 2})
    with extra_axis(XA, outside="tp"):
        record = PlacementRecord.of_regions({"w": whole, "c": cut}, {"dp": 2, "pp": 1, "xa": 2, "tp": 2})
        assert record.params["w"] == {"dp": Partial("avg"), "pp": Shard(None, 1), "xa": Replicate(), "tp": Replicate()}
        assert record.params["c"]["xa"] == Replicate() and record.params["c"]["tp"] == Shard(0, 2)
        assert record.replica_axes() == ("dp",)  # the same tokens on every xa rank: nothing to average
        # a global norm counts each element once: the xa copies divide the weight (a control: the record without)
        assert record.norm_weight() == {"w": 0.25, "c": 0.5}
        assert before.norm_weight() == {"w": 0.5, "c": 1.0}
    with extra_axis(XD):
        record = PlacementRecord.of_regions({"w": whole}, {"dp": 2, "pp": 1, "tp": 1, "xd": 2})
        assert record.params["w"]["xd"] == Partial("avg") and record.replica_axes() == ("dp", "xd")
        assert record.norm_weight() == {"w": 1.0}


def test_outside_the_block_the_axis_is_unknown_everywhere():
    """The negative control: the same sizes without the axis in the table are refused by name."""
    with extra_axis(XA):
        pass
    assert "xa" not in table.AXES and "xa" not in table.BUILD_ORDER
    with pytest.raises(ValueError, match="unknown axis 'xa'"):
        MeshAxes(xa=2)
    with pytest.raises(PlanError, match="unknown axis 'xa'"):
        validated({"dp": 2, "xa": 2})
    with pytest.raises(ConfigError) as info:
        _cfg(example_parallel_size=2)
    assert [p for p, m in info.value.errors if "unknown key" in m] == ["parallel.example_parallel_size"]
    with pytest.raises(ValueError, match="in the table already"):
        with extra_axis(Axis("tp2", "tensor_parallel_size")):
            pass

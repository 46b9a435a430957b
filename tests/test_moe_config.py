"""The ``model.moe`` config section (issue 40): every field reaches the model, bad values and the layouts the
single-process MoE block does not support are refused with one line naming the field."""

from __future__ import annotations

import pytest

from kuangchao_core.config import ConfigError, config_from_dict
from kuangchao_core.engine.plan import check_plan
from kuangchao_core.models.llama import config_from_model_section
from kuangchao_core.models.moe import MoeConfig

MOE = {"num_experts": 4, "top_k": 2}


def _job(moe=None, **sections):
    model = {"preset": "tiny", "num_layers": 4}
    if moe is not None:
        model["moe"] = moe
    return config_from_dict({"task": {"name": "t"}, "model": model, **sections})


def _errors(moe=None, **sections) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        _job(moe, **sections)
    return info.value.errors


def test_every_field_reaches_the_model_config():
    moe = {
        "num_experts": 6,
        "top_k": 3,
        "num_shared_experts": 1,
        "expert_intermediate_size": 32,
        "router": "sigmoid",
        "capacity_factor": 1.25,
        "aux_loss_coef": 0.001,
        "z_loss_coef": 0.0001,
        "balance": "bias",
        "bias_update_rate": 0.01,
        "layers": [1, 3],
    }
    cfg = config_from_model_section(_job(moe).model)
    assert cfg.moe == MoeConfig(**{**moe, "layers": (1, 3)})
    assert set(moe) | {"layer_interval"} == {f for f in MoeConfig.__dataclass_fields__}  # no field left unwired
    assert config_from_model_section(_job().model).moe is None  # the control: dense without the section
    assert config_from_model_section(_job({**MOE, "layer_interval": 2}).model).moe.moe_layers(4) == [0, 2]


def test_defaults_route_top2_of_8_dropless_with_the_aux_loss():
    moe = _job({}).model.moe
    assert (moe.num_experts, moe.top_k, moe.capacity_factor, moe.balance) == (8, 2, None, "aux_loss")


@pytest.mark.parametrize(
    ("moe", "path"),
    [
        ({"num_experts": 2, "top_k": 3}, "model.moe.top_k"),
        ({**MOE, "layers": [0, 4]}, "model.moe.layers"),
        ({**MOE, "layers": [1, 1]}, "model.moe.layers"),
        ({**MOE, "layers": [1], "layer_interval": 2}, "model.moe.layer_interval"),
        ({**MOE, "layer_interval": 5}, "model.moe.layer_interval"),
        ({**MOE, "aux_loss_coef": 0}, "model.moe.aux_loss_coef"),
        ({**MOE, "router": "relu"}, "model.moe.router"),
        ({**MOE, "capacity_factor": 0}, "model.moe.capacity_factor"),
        ({**MOE, "experts": 4}, "model.moe.experts"),  # an unknown key
    ],
)
def test_bad_settings_name_their_field(moe, path):
    errors = _errors(moe)
    assert [p for p, _ in errors] == [path], errors


def test_bias_balancing_may_drop_the_aux_loss_and_set_its_rate():
    assert _job({**MOE, "balance": "bias", "aux_loss_coef": 0, "bias_update_rate": 0.01}).model.moe.aux_loss_coef == 0


@pytest.mark.parametrize(
    ("sections", "path"),
    [
        ({"parallel": {"tensor_parallel_size": 2}}, "parallel.tensor_parallel_size"),
        ({"parallel": {"pipeline_parallel_size": 2}}, "parallel.pipeline_parallel_size"),
        ({"parallel": {"context_parallel_size": 2}}, "parallel.context_parallel_size"),
        ({"parallel": {"data_parallel_size": 2, "zero_stage": 3}}, "parallel.zero_stage"),
        ({"train": {"compile": True}}, "train.compile"),
        ({"tracking": {"register_model": "m"}}, "tracking.register_model"),
    ],
)
def test_layouts_moe_does_not_support_yet_are_refused_with_one_line(sections, path):
    _job(None, **sections)  # the control: the same layout without MoE is valid
    errors = _errors(MOE, **sections)
    assert path in [p for p, _ in errors]
    message = dict(errors)[path]
    assert "model.moe" in message and "\n" not in message


def test_data_parallelism_with_zero_up_to_2_is_allowed():
    assert _job(MOE, parallel={"data_parallel_size": 2, "zero_stage": 2}).model.moe.num_experts == 4


def test_expert_parallel_size_is_checked_with_one_line_each():
    ok = _job(MOE, parallel={"data_parallel_size": 4, "expert_parallel_size": 2})
    assert ok.parallel.expert_parallel_size == 2 and ok.parallel.world_size == 4  # carved out of dp: no processes
    assert config_from_dict(ok.to_dict()).parallel.expert_parallel_size == 2  # a worker reads it back
    cases = [
        (None, {"data_parallel_size": 2, "expert_parallel_size": 2}, {}, "parallel.expert_parallel_size", "none of"),
        (MOE, {"data_parallel_size": 3, "expert_parallel_size": 2}, {}, "parallel.expert_parallel_size", "divide data"),
        (
            {"num_experts": 3, "top_k": 1},
            {"data_parallel_size": 2, "expert_parallel_size": 2},
            {},
            "parallel.expert_parallel_size",
            "divide model.moe.num_experts 3",
        ),
        (MOE, {"data_parallel_size": 2, "expert_parallel_size": 2, "zero_stage": 1}, {}, "parallel.zero_stage", "0"),
        (
            MOE,
            {"data_parallel_size": 2, "expert_parallel_size": 2},
            {"dtype": "bf16", "param_dtype": "bf16"},
            "train.param_dtype",
            "masters",
        ),
    ]
    for moe, parallel, train, path, words in cases:
        errors = dict(_errors(moe, parallel=parallel, train=train))
        assert words in errors[path] and "\n" not in errors[path], (parallel, errors)
    refused = dict(check_plan(_job(MOE, parallel={"data_parallel_size": 2, "expert_parallel_size": 0})))
    assert refused["parallel.expert_parallel_size"] == "must be an integer >= 1, got 0"  # as any axis's size


def test_lora_is_refused_with_moe():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"task": {"name": "t"}, "model": {"preset": "tiny", "moe": MOE, "lora": {}}, "tracking": {}})
    assert "model.lora" in [p for p, _ in info.value.errors]


def test_a_dense_llama_checkpoint_is_refused_with_moe_when_the_model_is_built():
    """A Hugging Face ``model.checkpoint`` passes the job's checks with ``model.moe`` (a Mixtral's: issue 40 item
    4, ``tests/test_hf_moe.py``); a dense Llama's MLPs have no experts, which building the model config says."""
    dense = {"checkpoint": "tests/data/kc-tiny-demo"}
    assert config_from_model_section(dense).moe is None  # the control: the same checkpoint, dense
    with pytest.raises(ConfigError) as info:
        config_from_model_section({**dense, "moe": MOE})
    assert info.value.errors[0][0] == "model.moe" and "dense Llama" in info.value.errors[0][1]


def test_the_model_config_checks_moe_too():
    from kuangchao_core.models.llama import LlamaConfig

    with pytest.raises(ConfigError) as info:
        LlamaConfig(num_layers=2, moe=MoeConfig(num_experts=2, top_k=4)).validate()
    assert [p for p, _ in info.value.errors] == ["model.moe.top_k"]


def test_a_resolved_config_read_back_keeps_validating():
    # a worker reads the resolved config, where every field is set: checks may only look at values
    for moe in ({**MOE, "layers": [1, 3]}, {**MOE, "balance": "bias"}, MOE):
        cfg = _job(moe)
        again = config_from_dict(cfg.to_dict())
        assert again.model.moe == cfg.model.moe


def test_settings_moe_does_not_use_are_reported():
    from kuangchao_core.config.unused import unused_settings

    paths = [p for p, _ in unused_settings(_job({**MOE, "bias_update_rate": 0.01}, tracking={"log_model": True}))]
    assert paths == ["model.moe.bias_update_rate", "tracking.log_model"]
    assert unused_settings(_job({**MOE, "balance": "bias", "bias_update_rate": 0.01})) == []  # the control
    assert unused_settings(_job({**MOE, "layers": [1]})) == []


class _NoExport:
    def export_and_register(self, *args):
        raise AssertionError("exported")


def test_the_job_does_not_export_a_moe_model_by_default_and_says_so(caplog):
    import logging
    from types import SimpleNamespace

    from kuangchao_core.job.finish import _export

    logger = logging.getLogger("kuangchao.test_moe")
    with caplog.at_level(logging.WARNING, logger.name):
        got = _export(SimpleNamespace(cfg=_job(MOE)), _NoExport(), None, logger, {"path": "/c/step_5"}, {})
    assert got == (None, None) and "MoE model has no Hugging Face export" in caplog.text
    with pytest.raises(AssertionError, match="exported"):  # the control: a dense job goes on to export
        _export(
            SimpleNamespace(cfg=_job(), run_id="r", run_dir="/r"),
            _NoExport(),
            _Clock(),
            logger,
            {"path": "/c/step_5"},
            {"final_loss": 1.0},
        )


class _Clock:
    def phase(self, name):
        import contextlib

        return contextlib.nullcontext()

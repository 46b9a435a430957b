"""Issue 38 §7: credentials stay out of the Slurm job (``cluster.slurm.export_env``), and ``extra_sbatch_args``
cannot set a reserved sbatch option by an abbreviation, as sbatch's ``getopt_long`` reads it.

Negative controls: the attacks of the review (``export_env: [HF_TOKEN]`` reaching ``#SBATCH --export=``,
``--get-user=`` passing as an unreserved option) are each shown refused, and the same mechanism shown to let
the legitimate neighbours through (the explicit switch, ``--ntasks``, ``--mem``)."""

from __future__ import annotations

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.config.slurm_options import RESERVED_LONG, looks_secret, reserved_option
from kuangchao_core.errors import ConfigError
from kuangchao_core.sched.slurm import script
from tests.conftest_prefect import TINY
from tests.test_slurm_script import SLURM


def _errors(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [*SLURM, *overrides])
    return dict(info.value.errors)


def test_a_token_in_export_env_is_refused_naming_its_field_and_exported_only_when_allowed_with_a_warning():
    errors = _errors('cluster.slurm.export_env=["MY_SITE_VAR", "HF_TOKEN"]')
    assert list(errors) == ["cluster.slurm.export_env.1"]
    assert "HF_TOKEN looks like a credential" in errors["cluster.slurm.export_env.1"]
    assert "export_env_allow_secrets" in errors["cluster.slurm.export_env.1"]

    allowed = load_config(
        TINY,
        [
            *SLURM,
            'cluster.slurm.export_env=["MY_SITE_VAR", "HF_TOKEN"]',
            'cluster.slurm.export_env_allow_secrets=["HF_TOKEN"]',
        ],
    )
    env = {"MY_SITE_VAR": "1", "HF_TOKEN": "hf_x"}
    assert script.exported_names(allowed.cluster.slurm, env)[-2:] == ["MY_SITE_VAR", "HF_TOKEN"]
    [warning] = script.secret_warnings(allowed.cluster.slurm)
    assert "HF_TOKEN" in warning and warning.startswith("warning:")
    # the control: without the switch nothing secret is warned about, because nothing secret is exported
    plain = load_config(TINY, [*SLURM, 'cluster.slurm.export_env=["MY_SITE_VAR"]'])
    assert script.secret_warnings(plain.cluster.slurm) == []
    assert "HF_TOKEN" not in script.exported_names(plain.cluster.slurm, env)


def test_the_allow_switch_names_only_exported_variables():
    errors = _errors('cluster.slurm.export_env_allow_secrets=["HF_TOKEN"]')
    assert "is not in cluster.slurm.export_env" in errors["cluster.slurm.export_env_allow_secrets.0"]


@pytest.mark.parametrize(
    "name",
    ["PREFECT_API_KEY", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID",
     "MY_API_KEY", "DB_PASSWORD", "client_secret_file", "SOME_CREDENTIALS", "TOKEN"],
)  # fmt: skip
def test_credential_like_names_are_recognised(name):
    assert looks_secret(name)
    assert "cluster.slurm.export_env.0" in _errors(f'cluster.slurm.export_env=["{name}"]')


@pytest.mark.parametrize("name", ["MY_SITE_VAR", "NCCL_DEBUG", "KEYBOARD", "TOKENIZERS_PARALLELISM", "HF_HOME"])
def test_ordinary_names_are_not_taken_for_credentials(name):
    assert not looks_secret(name)
    assert load_config(TINY, [*SLURM, f'cluster.slurm.export_env=["{name}"]']).cluster.slurm.export_env == [name]


@pytest.mark.parametrize(
    ("arg", "option"),
    [("--get-user=10", "--get-user-env"), ("--get-u", "--get-user-env"), ("--expo=ALL", "--export"),
     ("--wr=echo", "--wrap"), ("--node=4", "--nodes"), ("--ntasks-per-n=8", "--ntasks-per-node"),
     ("--pars", "--parsable"), ("-N3", "--nodes"), ("-HN3", "--nodes"), ("--export=ALL", "--export")],
)  # fmt: skip
def test_every_abbreviation_of_a_reserved_option_is_refused(arg, option):
    assert option in reserved_option(arg)
    if arg != "--export=ALL":  # the control: the exact-name rule of before let each of these through
        assert arg.split("=", 1)[0] not in (*RESERVED_LONG, "-N")
    errors = _errors(f'cluster.slurm.extra_sbatch_args=["--mem=4G", "{arg}"]')
    assert list(errors) == ["cluster.slurm.extra_sbatch_args.1"]
    assert option in errors["cluster.slurm.extra_sbatch_args.1"]


@pytest.mark.parametrize("arg", ["--mem=64G", "--ntasks=4", "--reservation=r1", "--gres=gpu:2", "-J", "-JN", "-t10"])
def test_unreserved_options_pass(arg):
    assert reserved_option(arg) is None  # -JN is the job name "N": -J takes the rest of the group as its value
    cfg = load_config(TINY, [*SLURM, f'cluster.slurm.extra_sbatch_args=["{arg}"]'])
    assert cfg.cluster.slurm.extra_sbatch_args == [arg]


def test_kc_slurm_script_warns_about_an_allowed_secret_and_exports_it_by_name_only():
    from typer.testing import CliRunner

    from kuangchao.cli.main import app

    sets = [*SLURM, 'cluster.slurm.export_env=["HF_TOKEN"]', 'cluster.slurm.export_env_allow_secrets=["HF_TOKEN"]']
    args = ["slurm", "script", TINY, *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(app, args, env={"HF_TOKEN": "hf_secret_value"})
    assert result.exit_code == 0, result.output
    assert "warning: cluster.slurm.export_env exports HF_TOKEN" in result.output
    assert "hf_secret_value" not in result.output  # the name is exported, the value never written
    quiet = CliRunner().invoke(app, ["slurm", "script", TINY, *[a for s in SLURM for a in ("--set", s)]])
    assert quiet.exit_code == 0 and "warning" not in quiet.output  # the control: nothing secret, nothing said

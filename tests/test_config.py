"""The configuration layer: schema, safe YAML loading, extends, overrides, cross-field checks (SPEC L6.1, L6.2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kuangchao_core.config import MODEL_PRESETS, ConfigError, JobConfig, config_from_dict, deep_merge, load_config
from kuangchao_core.config.safe_yaml import MAX_EXPANDED_NODES, MAX_FILE_BYTES

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def errors_of(path: Path, overrides: tuple[str, ...] = ()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert info.value.source == str(path)
    return {where: msg for where, msg in info.value.errors}


# ------------------------------------------------------------------------------------------------ examples


def test_minimal_config_is_one_process_tiny_synthetic():
    cfg = config_from_dict({"task": {"name": "only-a-name"}})
    assert cfg.world_size == 1
    assert cfg.model.preset == "tiny"
    for key, value in MODEL_PRESETS["tiny"].items():
        assert getattr(cfg.model, key) == value
    assert cfg.data.is_synthetic
    assert cfg.tracking.experiment == "only-a-name"
    assert cfg.checkpoint.dir == "checkpoints"
    assert cfg.permission.mode == "enforcing"


#: The job example of the original design document (its section 2.6): every key and value as written there.
ORIGINAL_LLAMA3_EXAMPLE = """\
task:
  name: llama3-8b-finetune
  priority: high
model:
  type: llama
  params: 8e9
  checkpoint: /data/checkpoints/llama3-8b
parallel:
  data_parallel_size: 4
  tensor_parallel_size: 2
  pipeline_parallel_size: 2
  micro_batch_size: 4
  gradient_accumulation_steps: 8
optimizer:
  type: adamw
  lr: 2e-5
  weight_decay: 0.01
permission:
  token_ttl_seconds: 3600
  audit_log: /var/log/kuangchao/audit.log
  allowed_interfaces:
    - all_reduce
    - all_gather
    - broadcast
"""


def _assert_original_refused_for_send_recv(path: Path) -> None:
    """The original as written parses (every value in its type) and is refused by the plan: its pipeline's stage
    boundaries need send and recv, which its allowed_interfaces leave out; the refusal names the field."""
    from kuangchao_core.engine.plan import check_plan

    cfg = load_config(path)
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 2e-5
    assert cfg.permission.allowed_interfaces == ["all_reduce", "all_gather", "broadcast"]
    problems = dict(check_plan(cfg))
    assert "permission.allowed_interfaces" in problems, problems
    why = problems["permission.allowed_interfaces"]
    assert "pipeline_parallel_size 2" in why and "send, recv" in why, why


def test_original_llama3_example_as_written_parses_and_is_refused_for_its_missing_send_recv(tmp_path):
    path = write(tmp_path, "original.yaml", ORIGINAL_LLAMA3_EXAMPLE)
    raw = yaml.safe_load(path.read_text())
    assert raw["optimizer"]["lr"] == "2e-5", "plain yaml reads 2e-5 as a string; our loader must not"
    _assert_original_refused_for_send_recv(path)
    # the shipped example is the original plus send and recv, and nothing else
    shipped = yaml.safe_load((CONFIGS / "llama3-8b-finetune.yaml").read_text())
    raw["permission"]["allowed_interfaces"] += ["send", "recv"]
    assert shipped == raw


def test_negative_control_a_plan_blind_to_stage_boundaries_fails_the_refusal_check(tmp_path, monkeypatch):
    """Sabotage: the plan forgets that pipeline stages talk through send/recv; the check above must then fail."""
    from kuangchao_core.engine import plan

    real = plan.required_primitives
    monkeypatch.setattr(
        plan, "required_primitives", lambda cfg: {k: v for k, v in real(cfg).items() if k not in ("send", "recv")}
    )
    path = write(tmp_path, "original.yaml", ORIGINAL_LLAMA3_EXAMPLE)
    with pytest.raises(AssertionError):
        _assert_original_refused_for_send_recv(path)


def test_shipped_llama3_example_with_send_recv_loads_and_plans():
    from kuangchao_core.engine.plan import check_plan

    path = CONFIGS / "llama3-8b-finetune.yaml"
    cfg = load_config(path)
    # the plan's only remaining problem is the absent checkpoint (the weights are not on this machine)
    assert [where for where, _ in check_plan(cfg)] == ["model.checkpoint"]
    assert cfg.task.name == "llama3-8b-finetune" and cfg.task.priority == "high"
    assert cfg.model.type == "llama"
    assert isinstance(cfg.model.params, float) and cfg.model.params == 8e9
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 2e-5
    assert cfg.optimizer.weight_decay == 0.01
    p = cfg.parallel
    assert (p.data_parallel_size, p.tensor_parallel_size, p.pipeline_parallel_size) == (4, 2, 2)
    assert (p.micro_batch_size, p.gradient_accumulation_steps) == (4, 8)
    assert cfg.world_size == 16
    assert cfg.permission.token_ttl_seconds == 3600
    assert cfg.permission.audit_log == "/var/log/kuangchao/audit.log"
    # the original's list plus the send/recv its pipeline needs (the file says why)
    assert cfg.permission.allowed_interfaces == ["all_reduce", "all_gather", "broadcast", "send", "recv"]
    # no preset, a checkpoint: nothing is inferred from params, the shape comes from the checkpoint later
    assert cfg.model.checkpoint == "/data/checkpoints/llama3-8b"
    assert cfg.model.preset is None and cfg.model.hidden_size is None and cfg.model.num_layers is None
    assert not Path("/data/checkpoints/llama3-8b").exists()


def test_original_static_cluster_example_loads():
    cfg = load_config(CONFIGS / "cluster-static.yaml")
    assert cfg.cluster.mode == "static"
    assert [(n.host, n.gpus, n.role) for n in cfg.cluster.nodes] == [
        ("10.0.1.1", 8, "worker"),
        ("10.0.1.2", 8, "worker"),
        ("10.0.1.3", 8, "parameter_server"),
    ]
    # the parameter server's GPUs do not train: 8 + 8 worker GPUs = dp4 × tp2 × pp2
    assert cfg.cluster.devices == 16 == cfg.world_size
    assert cfg.task.name == "llama3-8b-finetune"  # inherited through extends


def test_tiny_demo_config():
    cfg = load_config(CONFIGS / "tiny.yaml")
    assert cfg.task.name == "kc-tiny-demo"
    assert cfg.model.preset == "tiny" and cfg.model.hidden_size == 64 and cfg.model.vocab_size == 256
    assert cfg.data.is_synthetic and cfg.data.synthetic.task == "arithmetic" and cfg.data.seq_len == 64
    assert cfg.parallel.data_parallel_size == 2 and cfg.parallel.micro_batch_size == 8
    assert cfg.parallel.gradient_accumulation_steps == 1
    assert cfg.optimizer.lr == 3e-3  # written `3e-3` in YAML, which safe_load reads as a string
    assert cfg.data.packing == "documents" and cfg.tracking.register_model == "kc-tiny-demo"
    assert 0 < cfg.train.warmup_steps < cfg.train.steps
    # checkpoints during the run and at its end, the last ones kept
    assert cfg.train.steps % cfg.checkpoint.interval == 0 and cfg.checkpoint.interval < cfg.train.steps
    assert cfg.checkpoint.keep_last >= 2
    assert cfg.cluster.mode == "local" and cfg.cluster.nproc_per_node == 2 == cfg.world_size
    assert cfg.permission.mode == "enforcing"


def test_extends_example_merges_maps_and_overrides_scalars():
    base = load_config(CONFIGS / "base.yaml")
    child = load_config(CONFIGS / "finetune-extends.yaml")
    assert child.task.name == "kc-finetune-extends"
    assert child.optimizer.lr == 5e-4 and base.optimizer.lr == 1e-3
    assert child.optimizer.weight_decay == base.optimizer.weight_decay == 0.01  # kept from the base map
    assert child.parallel.micro_batch_size == base.parallel.micro_batch_size == 8
    assert child.parallel.data_parallel_size == 2 and child.world_size == 2
    assert child.train.steps == base.train.steps == 60


# ------------------------------------------------------------------------------------------------ schema


def test_preset_fills_only_unset_fields():
    cfg = config_from_dict({"task": {"name": "t"}, "model": {"preset": "llama3-8b", "num_layers": 4}})
    assert cfg.model.hidden_size == 4096 and cfg.model.num_kv_heads == 8 and cfg.model.vocab_size == 128256
    assert cfg.model.num_layers == 4
    assert MODEL_PRESETS["llama3-8b"]["num_layers"] == 32


def test_numbers_written_as_strings_or_scientific(tmp_path):
    path = write(
        tmp_path,
        "n.yaml",
        "task: {name: n}\noptimizer: {lr: 1e-3, eps: .5e-7}\ntrain: {steps: 1e3, warmup_steps: 1_0}\n"
        "parallel: {bucket_size_mb: 5E1}\n",
    )
    cfg = load_config(path)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.eps == 0.5e-7
    assert cfg.train.steps == 1000 and isinstance(cfg.train.steps, int) and cfg.train.warmup_steps == 10
    assert cfg.parallel.bucket_size_mb == 50.0
    # the same through a plain dict holding strings
    cfg = config_from_dict({"task": {"name": "n"}, "optimizer": {"lr": "2e-5"}, "train": {"steps": "8e1"}})
    assert cfg.optimizer.lr == 2e-5 and cfg.train.steps == 80


def test_yaml_11_surprises_are_off(tmp_path):
    path = write(tmp_path, "y.yaml", "task: {name: y}\ncluster: {mode: static, nodes: [{host: no, gpus: 1}]}\n")
    cfg = load_config(path)
    assert cfg.cluster.nodes[0].host == "no"  # YAML 1.1 would read a boolean False


def test_unknown_key_is_named_with_a_hint(tmp_path):
    errs = errors_of(write(tmp_path, "u.yaml", "task: {name: u}\nparallel: {data_paralel_size: 2}\ntrian: {}\n"))
    assert "did you mean 'data_parallel_size'" in errs["parallel.data_paralel_size"]
    assert "did you mean 'train'" in errs["trian"]


def test_wrong_type_is_named(tmp_path):
    errs = errors_of(write(tmp_path, "w.yaml", "task: {name: w}\nparallel: {micro_batch_size: four}\n"))
    assert "integer" in errs["parallel.micro_batch_size"] and "'four'" in errs["parallel.micro_batch_size"]
    errs = errors_of(write(tmp_path, "b.yaml", "task: {name: w}\ntrain: {steps: true}\n"))
    assert "train.steps" in errs


def test_missing_name_and_nested_list_paths(tmp_path):
    errs = errors_of(
        write(tmp_path, "m.yaml", "task: {priority: urgent}\ncluster: {mode: static, nodes: [{host: a, gpus: -1}]}\n")
    )
    assert "task.name" in errs and "task.priority" in errs
    assert "greater than or equal to 0" in errs["cluster.nodes.0.gpus"]


def test_every_error_is_listed_at_once(tmp_path):
    path = write(
        tmp_path,
        "all.yaml",
        "task: {name: a}\noptimizer: {lr: -1}\ntrain: {steps: 10, warmup_steps: -1}\n"
        "parallel: {tensor_parallel_size: 3}\ncheckpoint: {interval: 0}\nlogging: {level: LOUD}\n",
    )
    errs = errors_of(path)
    for where in (
        "optimizer.lr",
        "train.warmup_steps",
        "parallel.tensor_parallel_size",
        "checkpoint.interval",
        "logging.level",
    ):
        assert where in errs, (where, errs)


def test_duplicate_keys_name_path_and_lines(tmp_path):
    path = write(tmp_path, "d.yaml", "task:\n  name: d\noptimizer:\n  lr: 1e-3\n  lr: 2e-3\n")
    errs = errors_of(path)
    assert errs == {"optimizer.lr": "duplicate key at line 5 (first set at line 4)"}


def test_world_size_against_local_cluster(tmp_path):
    path = write(
        tmp_path, "ws.yaml", "task: {name: w}\nparallel: {data_parallel_size: 4}\ncluster: {nproc_per_node: 2}\n"
    )
    msg = errors_of(path)["parallel.data_parallel_size"]
    assert "4×1×1 = 4" in msg and "nproc_per_node is 2" in msg


def test_world_size_against_static_cluster(tmp_path):
    errs = errors_of(CONFIGS / "cluster-static.yaml", ("parallel.data_parallel_size=2",))
    msg = errs["parallel.data_parallel_size"]
    assert "2×2×2 = 8" in msg and "8+8 = 16" in msg


@pytest.mark.parametrize(
    ("settings", "where", "fragment"),
    [
        (
            {"model": {"num_heads": 4, "num_kv_heads": 4}, "parallel": {"tensor_parallel_size": 8}},
            "parallel.tensor_parallel_size",
            "num_heads 4",
        ),
        (
            {"model": {"num_heads": 4, "num_kv_heads": 3}},
            "model.num_kv_heads",
            "num_kv_heads 3 must divide num_heads 4",
        ),
        ({"model": {"hidden_size": 66}}, "model.num_heads", "hidden_size 66"),
        ({"parallel": {"pipeline_parallel_size": 3}}, "parallel.pipeline_parallel_size", "num_layers 2"),
        (
            {
                "model": {"num_layers": 8},
                "parallel": {"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"},
            },
            "parallel.virtual_pipeline_size",
            "needs virtual_pipeline_size > 1",
        ),
        (
            {"model": {"num_layers": 8}, "parallel": {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2}},
            "parallel.virtual_pipeline_size",
            "needs pipeline_schedule",
        ),
        (
            {
                "model": {"num_layers": 8},
                "parallel": {
                    "pipeline_parallel_size": 2,
                    "virtual_pipeline_size": 2,
                    "pipeline_schedule": "interleaved_1f1b",
                    "gradient_accumulation_steps": 3,
                },
            },
            "parallel.gradient_accumulation_steps",
            "gradient_accumulation_steps 3",
        ),
        ({"train": {"log_interval": 0}}, "train.log_interval", "greater than or equal to 1"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last", "greater than or equal to 1"),
        ({"data": {"seq_len": 256}}, "data.seq_len", "exceeds model.max_seq_len 128"),
        ({"data": {"format": "jsonl"}}, "data.path", "needs a path"),
        (
            {"parallel": {"micro_batch_size": 64}, "data": {"synthetic": {"num_train": 10}}},
            "data.synthetic.num_train",
            "= 64",
        ),
        ({"cluster": {"mode": "static"}}, "cluster.nodes", "at least one node"),
        ({"cluster": {"mode": "dynamic"}}, "cluster.registry", "registry"),
        (
            {"permission": {"allowed_interfaces": ["all_reduce", "format_disk"]}},
            "permission.allowed_interfaces",
            "format_disk",
        ),
        ({"checkpoint": {"uri": "http://x"}}, "checkpoint.uri", "s3://"),
        ({"parallel": {"backend": "nccl"}, "train": {"device": "cpu"}}, "parallel.backend", "nccl"),
        (
            {"cluster": {"heartbeat_interval_s": 5, "heartbeat_timeout_s": 8}},
            "cluster.heartbeat_timeout_s",
            "heartbeat_timeout_s 8 must exceed twice heartbeat_interval_s 5",
        ),
        ({"cluster": {"max_restarts": -1}}, "cluster.max_restarts", "greater than or equal to 0"),
    ],
)
def test_cross_field_checks(settings, where, fragment):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"task": {"name": "x"}, **settings})
    errs = dict(info.value.errors)
    assert where in errs, errs
    assert fragment in errs[where]


def test_valid_3d_layout_passes():
    cfg = config_from_dict(
        {
            "task": {"name": "x"},
            "model": {"num_layers": 8},
            "parallel": {
                "data_parallel_size": 2,
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "virtual_pipeline_size": 2,
                "pipeline_schedule": "interleaved_1f1b",
                "gradient_accumulation_steps": 4,
            },
            "cluster": {"nproc_per_node": 8},
        }
    )
    assert cfg.world_size == 8 and cfg.parallel.global_batch_size == 4 * 4 * 2


def test_roles_accept_list_shorthand():
    cfg = config_from_dict({"task": {"name": "x"}, "permission": {"roles": {"monitor": ["metrics_read"]}}})
    assert cfg.permission.roles["monitor"].interfaces == ["metrics_read"]
    assert cfg.permission.roles["monitor"].resources == ["*"]


# ------------------------------------------------------------------------------------------------ loader safety


def test_missing_file_is_named(tmp_path):
    errs = errors_of(tmp_path / "absent.yaml")
    assert "absent.yaml" in errs["(file)"]


def test_oversized_file_refused(tmp_path):
    path = write(tmp_path, "big.yaml", "task: {name: big}\n" + "#" * (MAX_FILE_BYTES + 10) + "\n")
    assert "1048576-byte limit" in errors_of(path)["(file)"]


def test_alias_bomb_refused(tmp_path):
    lines = ["task: {name: bomb}", 'l0: &l0 ["x","x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 7):
        refs = ",".join([f"*l{i - 1}"] * 10)
        lines.append(f"l{i}: &l{i} [{refs}]")
    errs = errors_of(write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n"))
    # the first value that alone expands past the limit is named (l4 already holds 10**5 leaves)
    (where, msg), *_ = errs.items()
    assert where in ("l4", "l5", "l6") and str(MAX_EXPANDED_NODES) in msg


def test_too_many_aliases_refused(tmp_path):
    refs = ", ".join(["*a"] * 150)
    errs = errors_of(write(tmp_path, "many.yaml", f"task: {{name: m}}\nx: &a 1\ny: [{refs}]\n"))
    assert any(where.startswith("y.") and "alias" in msg for where, msg in errs.items()), errs


def test_recursive_alias_refused(tmp_path):
    errs = errors_of(write(tmp_path, "rec.yaml", "task: {name: r}\na: &a [*a]\n"))
    assert "recursive alias at line 2" in errs["(file)"]


def test_merge_keys_with_a_few_aliases_work(tmp_path):
    path = write(
        tmp_path,
        "merge.yaml",
        "task: {name: m}\npermission:\n  roles:\n    trainer: &t {interfaces: [all_reduce, send]}\n"
        "    debug:\n      <<: *t\n      resources: ['group:*']\n",
    )
    roles = load_config(path).permission.roles
    assert roles["debug"].interfaces == ["all_reduce", "send"] and roles["debug"].resources == ["group:*"]
    assert roles["trainer"].resources == ["*"]


def test_syntax_error_has_line(tmp_path):
    errs = errors_of(write(tmp_path, "s.yaml", "task:\n  name: s\n bad: [\n"))
    assert "line" in errs["(file)"]


def test_top_level_must_be_a_mapping(tmp_path):
    errs = errors_of(write(tmp_path, "l.yaml", "- a\n- b\n"))
    assert "mapping" in errs["(root)"]


# ------------------------------------------------------------------------------------------------ extends


def test_extends_chain_relative_to_each_file(tmp_path):
    write(tmp_path, "root/common/a.yaml", "task: {name: from-a, seed: 7}\noptimizer: {lr: 1e-3, weight_decay: 0.2}\n")
    write(tmp_path, "root/common/b.yaml", "extends: a.yaml\noptimizer: {lr: 2e-3}\ntrain: {steps: 30}\n")
    top = write(tmp_path, "root/jobs/c.yaml", "extends: ../common/b.yaml\ntask: {name: from-c}\n")
    cfg = load_config(top)
    assert (cfg.task.name, cfg.task.seed) == ("from-c", 7)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.train.steps) == (2e-3, 0.2, 30)


def test_extends_list_later_base_wins(tmp_path):
    write(tmp_path, "one.yaml", "task: {name: one}\noptimizer: {lr: 1e-3}\n")
    write(tmp_path, "two.yaml", "optimizer: {lr: 2e-3, weight_decay: 0.3}\n")
    cfg = load_config(write(tmp_path, "job.yaml", "extends: [one.yaml, two.yaml]\n"))
    assert (cfg.task.name, cfg.optimizer.lr, cfg.optimizer.weight_decay) == ("one", 2e-3, 0.3)


def test_extends_cycle_shows_chain(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\ntask: {name: a}\n")
    write(tmp_path, "b.yaml", "extends: [c.yaml]\n")
    write(tmp_path, "c.yaml", "extends: a.yaml\n")
    msg = errors_of(tmp_path / "a.yaml")["extends"]
    assert "cycle" in msg
    assert [Path(p.strip()).name for p in msg.split(": ", 1)[1].split("->")] == ["a.yaml", "b.yaml", "c.yaml", "a.yaml"]


def test_extends_missing_base_named(tmp_path):
    msg = errors_of(write(tmp_path, "job.yaml", "extends: nowhere.yaml\ntask: {name: j}\n"))["extends"]
    assert "'nowhere.yaml' not found" in msg and str(tmp_path / "nowhere.yaml") in msg


def test_error_in_base_file_names_that_file(tmp_path):
    write(tmp_path, "base.yaml", "optimizer:\n  lr: 1\n  lr: 2\n")
    errs = errors_of(write(tmp_path, "job.yaml", "extends: base.yaml\ntask: {name: j}\n"))
    assert "duplicate key" in errs["optimizer.lr"] and "base.yaml" in errs["optimizer.lr"]


def test_deep_merge_replaces_lists():
    base = {"a": {"x": [1, 2], "y": 1}, "b": 1}
    merged = deep_merge(base, {"a": {"x": [3]}})
    assert merged == {"a": {"x": [3], "y": 1}, "b": 1}
    assert base["a"]["x"] == [1, 2]


# ------------------------------------------------------------------------------------------------ overrides


def test_set_overrides_are_typed(tmp_path):
    cfg = load_config(
        CONFIGS / "cluster-static.yaml",
        (
            "optimizer.lr=1e-4",
            "train.steps=200",
            "train.deterministic=true",
            "permission.allowed_interfaces=[send, recv]",
            "task.name=2024",
            "cluster.nodes.1.gpus=4",
            "cluster.nodes.0.gpus=4",
            "parallel.data_parallel_size=2",
        ),
    )
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.steps == 200 and cfg.train.deterministic is True
    assert cfg.permission.allowed_interfaces == ["send", "recv"]
    assert cfg.task.name == "2024"
    assert [n.gpus for n in cfg.cluster.nodes] == [4, 4, 8] and cfg.world_size == 8


def test_set_unknown_path_and_bad_value(tmp_path):
    errs = errors_of(CONFIGS / "tiny.yaml", ("optimizer.learning_rate=1", "parallel.micro_batch_size=many", "nokey"))
    assert "'learning_rate'" in errs["optimizer.learning_rate"]
    assert "integer" in errs["parallel.micro_batch_size"]
    assert "KEY=VALUE" in errs["--set"]


def test_set_can_create_sections_and_dict_entries():
    path = CONFIGS / "tiny.yaml"
    cfg = load_config(path, ("permission.roles.monitor.interfaces=[metrics_read]", "tracking.experiment=exp"))
    assert cfg.permission.roles["monitor"].interfaces == ["metrics_read"]
    assert cfg.tracking.experiment == "exp"


# ------------------------------------------------------------------------------------------------ outputs


def test_to_yaml_round_trips_with_same_hash(tmp_path):
    cfg = load_config(CONFIGS / "cluster-static.yaml", ("optimizer.lr=3e-5",))
    again = load_config(write(tmp_path, "resolved.yaml", cfg.to_yaml()))
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
    changed = load_config(CONFIGS / "cluster-static.yaml", ("optimizer.lr=4e-5",))
    assert changed.config_hash() != cfg.config_hash()


def test_flat_gives_dotted_scalars():
    cfg = load_config(CONFIGS / "cluster-static.yaml")
    flat = cfg.flat()
    assert flat["optimizer.lr"] == 2e-5
    assert flat["parallel.tensor_parallel_size"] == 2
    assert flat["cluster.nodes.2.role"] == "parameter_server"
    assert json.loads(flat["permission.allowed_interfaces"]) == [
        "all_reduce",
        "all_gather",
        "broadcast",
        "send",
        "recv",
    ]
    assert all(v is None or isinstance(v, str | int | float | bool) for v in flat.values())


def test_job_config_validates_directly():
    with pytest.raises(ConfigError) as info:
        JobConfig.model_validate({"task": {"name": "x"}, "parallel": {"backend": "nccl"}, "train": {"device": "cpu"}})
    assert "nccl" in dict(info.value.errors)["parallel.backend"]


def test_warmup_longer_than_the_run_is_accepted_and_never_peaks():
    from kuangchao_core.engine.schedule import lr_at

    cfg = config_from_dict({"task": {"name": "w"}, "train": {"steps": 4, "warmup_steps": 10}})
    lrs = [lr_at(s, 1.0, cfg.train.steps, cfg.train.warmup_steps) for s in range(cfg.train.steps)]
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4])  # linear warmup, cut short by the end of the run


def test_settings_the_job_does_not_use_are_named_and_defaults_are_quiet(tmp_path):
    from typer.testing import CliRunner

    from kuangchao.cli.main import app
    from kuangchao_core.config.unused import unused_settings

    assert unused_settings(load_config(CONFIGS / "tiny.yaml")) == []
    assert unused_settings(load_config(CONFIGS / "finetune-demo.yaml")) == []
    assert unused_settings(config_from_dict({"task": {"name": "d"}})) == []  # every default: nothing to say
    cases = {
        "checkpoint.endpoint_url": {"checkpoint": {"endpoint_url": "http://127.0.0.1:9000"}},
        "train.min_lr_ratio": {"train": {"lr_schedule": "constant", "min_lr_ratio": 0.5}},
        "parallel.pipeline_schedule": {"parallel": {"pipeline_schedule": "afab"}},
        "data.text_field": {"data": {"text_field": "body"}},
        "data.synthetic": {"data": {"path": str(tmp_path), "format": "jsonl", "synthetic": {"num_train": 10}}},
        "permission.token_ttl_seconds": {"permission": {"mode": "trusted", "token_ttl_seconds": 60}},
        "cluster.registry": {"cluster": {"registry": "prefect://pool"}},
        "task.priority": {"task": {"priority": "high"}},
        "train.loss_scaling": {"train": {"dtype": "bf16", "loss_scaling": {"initial_scale": 8}}},
        "parallel.grad_reduce_dtype": {"parallel": {"zero_stage": 1, "grad_reduce_dtype": "bf16"}},
        "train.warmup_steps": {"train": {"steps": 4, "warmup_steps": 4}},
    }
    for path, section in cases.items():
        raw = {"task": {"name": "u"}, **section}
        raw["task"] = {"name": "u", **section.get("task", {})}
        found = dict(unused_settings(config_from_dict(raw)))
        assert list(found) == [path], (path, found)
    # the same setting used where it means something: no warning
    used = {"checkpoint": {"uri": "s3://b/p", "endpoint_url": "http://127.0.0.1:9000"}, "task": {"name": "u"}}
    assert unused_settings(config_from_dict(used)) == []
    cfg_file = write(tmp_path, "u.yaml", "task: {name: u}\ncheckpoint: {endpoint_url: 'http://127.0.0.1:9000'}\n")
    res = CliRunner().invoke(app, ["config", "validate", str(cfg_file)])
    assert res.exit_code == 0
    assert f"{cfg_file}: warning: checkpoint.endpoint_url: only used with checkpoint.uri" in res.output

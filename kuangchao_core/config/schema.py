"""The job configuration schema (SPEC L6.1): one pydantic v2 model per section, unknown keys refused everywhere.

A config holding only ``task.name`` is valid: one process, the ``tiny`` model, a synthetic corpus.
Checks that involve more than one field live in :mod:`kuangchao_core.config.checks` so that every error,
with the numbers involved, can be reported at once under its own dotted path.

The config reference, read top to bottom, section by section; what every section shares (:mod:`.section`),
``cluster`` with its Slurm job (:mod:`.cluster_schema`), ``train`` with its anomaly, loss scaling and evaluation
settings (:mod:`.train_schema`), ``tracking`` and ``model.vision`` live beside it.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, field_validator, model_validator

from kuangchao_core.axes import MeshAxes
from kuangchao_core.config.cluster_schema import ClusterSection, NodeSpec, SlurmSection  # noqa: F401
from kuangchao_core.config.hal_schema import HalSection
from kuangchao_core.config.lora_schema import LORA_TARGETS, LoraSection  # noqa: F401
from kuangchao_core.config.moe_schema import MoeSection
from kuangchao_core.config.presets import MODEL_PRESETS
from kuangchao_core.config.section import AxesSection, Float, Int, Section, _number  # noqa: F401
from kuangchao_core.config.tracking_schema import DEFAULT_PROMETHEUS_PORT, PROMETHEUS_PORT_SPAN, TrackingSection  # noqa: F401
from kuangchao_core.config.train_schema import ANOMALY_DEFAULT_ACTIONS, AnomalySection, TrainSection  # noqa: F401
from kuangchao_core.config.vision_schema import ImagesSection, VisionSection
from kuangchao_core.guard_api import INTERFACES

#: interface names the permission layer guards: the one registry, :data:`kuangchao_core.guard_api.INTERFACES`
KNOWN_INTERFACES: frozenset[str] = INTERFACES


class TaskSection(Section):
    """What the job is called and how it is seeded."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    priority: Literal["low", "normal", "high"] = "normal"
    seed: Int = 1234


class ModelSection(Section):
    """The model's shape. A preset fills the fields left unset; fields set explicitly win.

    Without a preset and without a checkpoint the ``tiny`` preset applies. With a ``checkpoint`` and no preset,
    unset shape fields stay ``None``: the shape is then read from the checkpoint's ``config.json`` when the model
    is built (loading a config never touches the checkpoint path). ``params`` is informative only.
    """

    type: Literal["llama"] = "llama"
    preset: Literal["tiny", "small", "125m", "1b", "llama3-8b"] | None = None
    params: Float | None = Field(default=None, gt=0)
    checkpoint: str | None = None
    vocab_size: Int | None = Field(default=None, ge=1)
    hidden_size: Int | None = Field(default=None, ge=1)
    intermediate_size: Int | None = Field(default=None, ge=1)
    num_layers: Int | None = Field(default=None, ge=1)
    num_heads: Int | None = Field(default=None, ge=1)
    num_kv_heads: Int | None = Field(default=None, ge=1)
    max_seq_len: Int | None = Field(default=None, ge=1)
    rope_theta: Float | None = Field(default=None, gt=0)
    norm_eps: Float | None = Field(default=None, gt=0)
    tie_embeddings: bool | None = None
    dropout: float | None = Field(default=None, ge=0.0, lt=1.0, description="residual dropout (0 = off)")
    lora: LoraSection | None = Field(default=None, description="fine-tune low-rank adapters (unset: every weight)")
    moe: MoeSection | None = Field(default=None, description="mixture-of-experts MLPs (issue 40; unset: dense)")
    vision: VisionSection | None = Field(default=None, description="a LLaVA vision tower (unset: text only)")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        preset = data.get("preset")
        if preset is None and not data.get("checkpoint"):
            data["preset"] = preset = "tiny"
        if isinstance(preset, str) and preset in MODEL_PRESETS:
            for key, value in MODEL_PRESETS[preset].items():
                if data.get(key) is None:
                    data[key] = value
        return data

    @property
    def head_dim(self) -> int | None:
        """Width of one attention head, when the shape is known."""
        return self.hidden_size // self.num_heads if self.hidden_size and self.num_heads else None


class SyntheticSection(Section):
    """The corpus the project generates itself (used when ``data.path`` is empty)."""

    task: Literal["arithmetic", "addition", "subtraction", "addition-question"] = "arithmetic"
    num_train: Int = Field(default=4096, ge=1)
    num_eval: Int = Field(default=256, ge=0)
    seed: Int = 0
    #: problems as prompt/completion records trained on the answer only (as ``data.format: sft``), not text lines
    instructions: bool = False


class DataSection(Section):
    """Where the tokens come from."""

    path: str | None = None
    #: ``sft``: instruction records (prompt/completion or chat messages, jsonl or parquet), loss on the answers only
    format: Literal["auto", "txt", "jsonl", "parquet", "synthetic", "sft"] = "auto"
    text_field: str = Field(default="text", min_length=1)
    #: ``.txt`` documents: ``file``: each file is one document, its bytes as written (blank lines kept), read in pieces
    #: of any size; ``blank_lines``: blank lines separate documents and are dropped (the rule before issue 39)
    txt_documents: Literal["file", "blank_lines"] = "file"
    #: ``byte``, a tokenizers JSON file, or a local Hugging Face tokenizer dir (its chat template renders sft messages)
    tokenizer: str = Field(default="byte", min_length=1)
    seq_len: Int = Field(default=128, ge=2)
    #: ``concat``: documents end to end, cut into windows; ``documents``: the same, but attention stays inside each
    #: document and positions restart; ``none``: one sft example per row, padded; ``auto``: ``none`` for sft data,
    #: ``concat`` otherwise
    packing: Literal["auto", "concat", "documents", "none"] = "auto"
    #: an sft example longer than one window: ``drop`` it or ``truncate`` it to ``seq_len + 1`` tokens
    truncation: Literal["drop", "truncate"] = "drop"
    #: tokenize text files once into memory-mapped arrays here, shared by every rank, attempt and later run
    #: (``kc data prepare``); unset: every rank tokenizes the files at start
    cache_dir: str | None = None
    #: held-out data like ``path``: ``eval_loss`` every ``train.eval_interval`` steps, exact-match accuracy for sft
    eval_path: str | None = None
    synthetic: SyntheticSection = Field(default_factory=SyntheticSection)
    images: ImagesSection = Field(default_factory=ImagesSection)
    prefetch: Int = Field(default=2, ge=0)
    shuffle: bool = True

    @property
    def is_synthetic(self) -> bool:
        """True when the job trains on the generated corpus."""
        return self.format == "synthetic" or (self.path is None and self.format == "auto")


class ParallelSection(AxesSection):
    """The layout: data × context × pipeline × tensor parallel sizes (``axes``), batches, schedule, ZeRO, buckets.

    DP gradient buckets (``zero_stage: 0``): ``hierarchical_allreduce`` (``auto``: when a DP group spans nodes
    with several members on each) sums them node-locally first; ``grad_compression`` sends them across nodes as
    fp16/bf16 or as the top ``topk_ratio`` of their entries with error feedback (the ratio warms up from dense
    over ``topk_warmup_steps``).
    """

    data_parallel_size: Int = Field(default=1, ge=1)
    tensor_parallel_size: Int = Field(default=1, ge=1)
    pipeline_parallel_size: Int = Field(default=1, ge=1)
    context_parallel_size: Int = Field(default=1, ge=1, description="ranks that split each sequence (issue 30)")
    micro_batch_size: Int = Field(default=4, ge=1)
    gradient_accumulation_steps: Int = Field(default=1, ge=1)
    virtual_pipeline_size: Int = Field(default=1, ge=1)
    pipeline_schedule: Literal["1f1b", "interleaved_1f1b", "afab"] = "1f1b"
    #: 1: AdamW state sharded over DP; 2: gradients too; 3: parameters too (gathered per block; with PP runs as 2)
    zero_stage: Literal[0, 1, 2, 3] = 0
    sequence_parallel: bool = False  # Megatron's: norms/residuals split along s over TP (tp > 1, seq_len % tp == 0)
    bucket_size_mb: Float = Field(default=25.0, gt=0)
    hierarchical_allreduce: Literal["auto", "on", "off"] = "auto"
    grad_compression: Literal["none", "fp16", "bf16", "topk"] = "none"
    #: the dtype DP gradient buckets are summed in (fp32 gradients of mixed precision; bf16 halves the bytes)
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    topk_ratio: Float = Field(default=0.01, gt=0, le=1)
    topk_warmup_steps: Int = Field(default=0, ge=0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_ms: Int = Field(default=300_000, ge=1)

    @property
    def world_size(self) -> int:
        """Processes the layout needs: the product of the axes' sizes (dp × cp × pp × tp)."""
        return MeshAxes.from_parallel(self).world_size

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro batch × accumulation × dp."""
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size


class OptimizerSection(Section):
    """AdamW settings."""

    type: Literal["adamw"] = "adamw"
    lr: Float = Field(default=3e-4, gt=0)
    weight_decay: Float = Field(default=0.0, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.95)
    eps: Float = Field(default=1e-8, gt=0)
    max_grad_norm: Float | None = Field(default=1.0, gt=0)
    #: parameter kinds weight decay skips: ``norm`` (1-D scales), ``embedding`` (the token embedding)
    weight_decay_exclude: list[Literal["norm", "embedding"]] = Field(default_factory=lambda: ["norm", "embedding"])

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        for beta in value:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"each beta must be in [0, 1); got {list(value)}")
        return value


class RoleSpec(Section):
    """What one role may do: interface names (``*`` for all) on resources (glob patterns)."""

    interfaces: list[str] = Field(default_factory=list)
    resources: list[str] = Field(default_factory=lambda: ["*"])

    @model_validator(mode="before")
    @classmethod
    def _list_shorthand(cls, data: Any) -> Any:
        # ``trainer: [all_reduce, send]`` is short for ``trainer: {interfaces: [all_reduce, send]}``
        if isinstance(data, list):
            return {"interfaces": data}
        return data

    @field_validator("interfaces")
    @classmethod
    def _known_interfaces(cls, value: list[str]) -> list[str]:
        return _check_interfaces(value, allow_star=True)


def _check_interfaces(value: list[str], allow_star: bool) -> list[str]:
    unknown = [name for name in value if name not in KNOWN_INTERFACES and not (allow_star and name == "*")]
    if unknown:
        raise ValueError(f"unknown interface(s) {unknown}; known: {', '.join(sorted(KNOWN_INTERFACES))}")
    duplicates = sorted({name for name in value if value.count(name) > 1})
    if duplicates:
        raise ValueError(f"interface(s) listed twice: {duplicates}")
    return value


class PermissionSection(Section):
    """Capability tokens and audit (L5). ``roles`` empty means the permission layer's built-in roles."""

    mode: Literal["enforcing", "trusted"] = "enforcing"
    token_ttl_seconds: Int = Field(default=3600, ge=1, le=24 * 3600)  # the verifier's maximum, never raised
    audit_log: str | None = None
    pin_store: str | None = None  # an append-only audit pin store directory (default $KC_AUDIT_PIN_STORE)
    allowed_interfaces: list[str] | None = None
    roles: dict[str, RoleSpec] = Field(default_factory=dict)
    #: operator keys (``NAME:PUBLIC_KEY``, as ``kc operator show`` prints them) that may change or revoke in a
    #: running job, besides the key of whoever starts it
    operators: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("operators")
    @classmethod
    def _operator_keys(cls, value: list[str]) -> list[str]:
        for spec in value:
            name, sep, key = str(spec).partition(":")
            if (
                not sep
                or not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", name)
                or not re.fullmatch(r"[A-Za-z0-9_-]{43}", key)
            ):
                raise ValueError(f"{spec!r} is not NAME:PUBLIC_KEY (as `kc operator show` prints it)")
        return value

    @field_validator("allowed_interfaces")
    @classmethod
    def _known_interfaces(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else _check_interfaces(value, allow_star=False)


class CheckpointSection(Section):
    """Where and how often checkpoints are written, and how a run resumes."""

    model_config = ConfigDict(**Section.model_config, populate_by_name=True)

    dir: str = Field(default="checkpoints", min_length=1)
    uri: str | None = None
    endpoint_url: str | None = None
    interval: Int = Field(default=100, ge=1)
    keep_last: Int = Field(default=3, ge=1)
    resume: str = Field(default="auto", min_length=1)
    #: ``async: true`` — snapshot to host memory and write in the background (``ckpt.async_save``)
    async_: bool = Field(default=False, alias="async")

    @field_validator("uri")
    @classmethod
    def _s3_uri(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("s3://") or len(value) <= len("s3://")):
            raise ValueError(f"must look like s3://bucket/prefix, got {value!r}")
        return value


class LoggingSection(Section):
    """Structured logs: level, optional JSON-lines file, console view."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_file: str | None = None
    console: bool = True

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


#: top-level key -> section model, in the order a resolved config is printed
SECTIONS: dict[str, type[Section]] = {
    "task": TaskSection,
    "model": ModelSection,
    "data": DataSection,
    "parallel": ParallelSection,
    "optimizer": OptimizerSection,
    "train": TrainSection,
    "permission": PermissionSection,
    "cluster": ClusterSection,
    "checkpoint": CheckpointSection,
    "tracking": TrackingSection,
    "logging": LoggingSection,
    "hal": HalSection,
}


class JobConfig(Section):
    """A complete, validated job description. Build it with ``load_config`` or ``config_from_dict``."""

    task: TaskSection
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    permission: PermissionSection = Field(default_factory=PermissionSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    hal: HalSection = Field(default_factory=HalSection)

    @model_validator(mode="after")
    def _cross_checks(self) -> JobConfig:
        from kuangchao_core.config.checks import cross_checks
        from kuangchao_core.errors import ConfigError

        if self.tracking.experiment is None:
            self.tracking.experiment = self.task.name
        errors = cross_checks(dict(self))
        if errors:
            # not a ValueError, so pydantic lets it through with every path intact
            raise ConfigError(errors)
        return self

    @property
    def world_size(self) -> int:
        """Processes the job needs: dp × cp × pp × tp."""
        return self.parallel.world_size

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain YAML/JSON-safe data, sections in canonical order."""
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        """The resolved config as YAML; ``load_config`` reads it back to an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True)

    def flat(self) -> dict[str, str | int | float | bool | None]:
        """Dotted keys to scalars (MLflow params). Lists of scalars become JSON strings; list items of maps are indexed."""
        out: dict[str, str | int | float | bool | None] = {}
        _flatten(self.to_dict(), "", out)
        return out

    def config_hash(self) -> str:
        """A stable 16-hex-digit fingerprint of the resolved config (canonical JSON, sha256)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        if not value and prefix:
            out[prefix] = "{}"
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list):
        if any(isinstance(item, dict | list) for item in value):
            for index, item in enumerate(value):
                _flatten(item, f"{prefix}.{index}", out)
        else:
            out[prefix] = json.dumps(value)
    else:
        out[prefix] = value

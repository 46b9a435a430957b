"""Job configuration (L6 user interface, imported by every layer as the schema): pydantic v2 schema, safe YAML
loading with ``extends:`` and ``--set`` overrides.

May import: ``errors`` and the registry of interface names in ``guard_api`` (beside ``errors``).
"""

from kuangchao_core.config.loader import apply_overrides, config_from_dict, deep_merge, load_config, parse_yaml
from kuangchao_core.config.presets import MODEL_PRESETS
from kuangchao_core.config.schema import KNOWN_INTERFACES, SECTIONS, JobConfig
from kuangchao_core.config.settings import RunSettings, run_settings
from kuangchao_core.errors import ConfigError

__all__ = [
    "KNOWN_INTERFACES",
    "MODEL_PRESETS",
    "SECTIONS",
    "ConfigError",
    "JobConfig",
    "RunSettings",
    "apply_overrides",
    "config_from_dict",
    "deep_merge",
    "load_config",
    "parse_yaml",
    "run_settings",
]

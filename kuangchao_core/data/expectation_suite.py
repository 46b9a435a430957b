"""The great-expectations suite over the records' facts (``data.validation``'s docstring names each expectation) and
its run: each expectation's outcome as plain JSON values, which ``data.validation_cache`` may keep."""

from __future__ import annotations

import inspect
import logging
import math
import os
from typing import Any


def build_suite(
    gx: Any, max_record_bytes: int, min_tokens: int, max_duplicate_share: float
) -> tuple[Any, dict[str, str]]:
    """The suite over the records' facts, each expectation named in its ``meta``; and each one's expected text."""
    E = gx.expectations
    suite = gx.ExpectationSuite(name="kuangchao_data")
    specs = [
        (E.ExpectTableRowCountToBeBetween(min_value=1), "not_empty", ">= 1 record"),
        (E.ExpectColumnValuesToBeInSet(column="is_blank", value_set=[False]), "no_empty_records", "0 empty records"),
        (
            E.ExpectColumnValuesToBeBetween(column="n_bytes", max_value=max_record_bytes),
            "no_oversize_records",
            f"every record <= {max_record_bytes} bytes",
        ),
        (E.ExpectColumnValuesToBeInSet(column="is_valid_utf8", value_set=[True]), "valid_utf8", "all valid UTF-8"),
        (
            E.ExpectColumnValuesToBeInSet(column="has_control", value_set=[False]),
            "no_control_chars",
            "no NUL or control characters",
        ),
        (E.ExpectColumnSumToBeBetween(column="n_tokens", min_value=min_tokens), "enough_tokens", f">= {min_tokens}"),
        (
            E.ExpectColumnProportionOfUniqueValuesToBeBetween(column="text_hash", min_value=1.0 - max_duplicate_share),
            "duplicate_share",
            f"duplicate share <= {max_duplicate_share:g}",
        ),
    ]
    expected = {}
    for exp, name, text in specs:
        exp.meta = {"name": name}
        suite.add_expectation(exp)
        expected[name] = text
    return suite, expected


def suite_outcomes(df: Any, max_record_bytes: int, min_tokens: int, max_duplicate_share: float) -> list[dict[str, Any]]:
    """Run the suite over the facts ``df`` in an ephemeral context: per expectation, its name, success, type,
    observed value, expected text and the message of an exception it raised ("" when none)."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_def = (
        ctx.data_sources.add_pandas("kuangchao_records")
        .add_dataframe_asset("records")
        .add_batch_definition_whole_dataframe("all")
    )
    suite, expected = build_suite(gx, max_record_bytes, min_tokens, max_duplicate_share)
    gx_result = batch_def.get_batch(batch_parameters={"dataframe": df}).validate(ctx.suites.add(suite))
    outcomes = []
    for er in gx_result.results:
        name = (er.expectation_config.meta or {}).get("name", er.expectation_config.type)
        exc = er.exception_info or {}
        raised = exc.get("raised_exception") if isinstance(exc, dict) else False
        outcomes.append(
            {
                "name": name,
                "success": bool(er.success),
                "expectation": er.expectation_config.type,
                "observed": _plain(er.result.get("observed_value")),
                "expected": expected.get(name, ""),
                "raised": str(exc.get("exception_message")) if raised else "",
            }
        )
    return outcomes


def suite_source() -> str:
    """The code that defines and runs the suite (part of the outcomes' cache key)."""
    return inspect.getsource(build_suite) + inspect.getsource(suite_outcomes)


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)

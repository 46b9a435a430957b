"""The job's usable result (the work of the Prefect task ``export-model``, ``tasks/export_model.py``): its final
checkpoint exported with the tokenizer, logged to MLflow as the run's model (an MLflow pyfunc model for a whole
model: ``mlflow.pyfunc.load_model`` answers prompts, :mod:`kuangchao_core.obs.mlflow_model`) and, with
``tracking.register_model``, registered: alias ``newest`` on every registered version, ``champion`` only when the run
beats the champion on the same held-out evaluation (:mod:`kuangchao_core.obs.champion`); the result's ``registry``
says which alias moved and why.

A diverged model (a non-finite weight or final loss) is refused before anything is exported, logged or registered
(``NotPublishable``, :mod:`kuangchao_core.obs.publish_gate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuangchao_core.engine.release import export_model
from kuangchao_core.obs import tracking
from kuangchao_core.obs.mlflow_model import write_pyfunc_files
from kuangchao_core.obs.model_registry import log_model_dir, register_model


def export_and_register_model(
    cfg: Any, run_id: str, step_dir: str, run_dir: str, final_loss: float | None, logger: Any
) -> dict[str, Any]:
    """Export ``step_dir`` into ``<run_dir>/model`` (HF model or PEFT adapters, tokenizer files, ``export.json``),
    log it to MLflow run ``run_id`` and register it when configured. Returns the export record with ``dir``,
    ``artifact_uri``, ``registered`` (name, version, aliases; None when not registered) and ``registry`` (which
    aliases moved and why; None without ``tracking.register_model``). ``final_loss``: the run's final training
    loss; a non-finite one, or a non-finite weight, raises ``NotPublishable`` first."""
    from kuangchao_core.models.llama import config_from_model_section

    out = Path(run_dir) / "model"
    max_length = config_from_model_section(cfg.model).max_seq_len
    record = export_model(step_dir, out, cfg.data.tokenizer, max_length, final_loss=final_loss)
    record = write_pyfunc_files(out, record)
    source = log_model_dir(cfg, run_id, out, record)
    registered = decision = None
    if cfg.tracking.register_model:
        evals = tracking.metric_history(cfg, run_id, "eval_loss")
        eval_loss = evals[-1][1] if evals else None
        registered = register_model(
            cfg, run_id, cfg.tracking.register_model, source, record, eval_loss, final_loss=final_loss, model_dir=out
        )
        decision = registered["decision"]
        logger.info("registry: %s", decision)
        if registered["version"] is None:
            registered = None
    return {**record, "dir": str(out), "artifact_uri": source, "registered": registered, "registry": decision}

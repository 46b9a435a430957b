"""The ``tracking`` section: the MLflow store and experiment, how long a locked store is waited for, the job's
Prometheus endpoint and Pushgateway, system metrics, and the model's export and registration."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kuangchao_core.config.section import Float, Int, Section

#: ``tracking.prometheus_port``'s default, and how many ports from it a job tries when others hold the first ones
DEFAULT_PROMETHEUS_PORT, PROMETHEUS_PORT_SPAN = 9400, 16


class TrackingSection(Section):
    """MLflow: store URI and experiment (defaults to ``task.name``)."""

    uri: str = Field(default="sqlite:///mlflow.db", min_length=1)
    experiment: str | None = None
    #: a store another process holds locked (SQLite's ``database is locked``) is waited for this long, at the job's
    #: start and at every write, before the job ends with one line saying so; 0 fails at once
    store_wait_s: Float = Field(default=60.0, ge=0, le=3600)
    #: the job's Prometheus ``/metrics`` (served by the orchestrator): this port, or when another job holds it the
    #: first free one of the next ``PROMETHEUS_PORT_SPAN - 1`` (a Prometheus scrapes 9400-9415); 0 for any free
    #: port, null for none
    prometheus_port: Int | None = Field(default=DEFAULT_PROMETHEUS_PORT, ge=0, le=65535)
    prometheus_host: str = Field(default="127.0.0.1", min_length=1)
    #: after the last step the endpoint stays up until a scrape has read the final values, at most this long (a job
    #: nothing scraped ends at once)
    prometheus_grace_s: Float = Field(default=60.0, ge=0, le=3600)
    #: a Pushgateway (``http://host:9091``): the job's final metrics are pushed there when it ends (grouped by
    #: ``job="kuangchao"``, ``task`` and ``run``), for a Prometheus that scrapes the gateway, not the job
    prometheus_pushgateway: str | None = Field(default=None, min_length=1)

    @field_validator("prometheus_pushgateway")
    @classmethod
    def _gateway_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        return value

    #: CPU, memory (and GPU) of every node into the MLflow run, sampled every ``system_metrics_interval_s``
    system_metrics: bool = True
    system_metrics_interval_s: Float = Field(default=10.0, ge=0.1, le=3600)
    #: at the end of a job, export its final checkpoint (Hugging Face model, or PEFT adapters for LoRA, with the
    #: tokenizer files) into the run directory and log it as the MLflow run's ``model``
    log_model: bool = True
    #: register the logged model under this name; alias ``newest`` follows every registered version, ``champion``
    #: only a version whose ``champion_metric`` beats the champion's on the same held-out evaluation
    #: (``kuangchao_core.obs.champion``); fine-tunes start from ``models:/NAME@champion``
    register_model: str | None = Field(default=None, min_length=1, max_length=256)
    #: which runs become a model version: ``publishable`` — every run whose model passes the publish gate (finite
    #: weights and final loss), moving ``newest``; ``champion`` — only a run that takes ``champion`` (the others'
    #: models stay logged on their runs)
    register_if: Literal["publishable", "champion"] = "publishable"
    #: the held-out metric that decides ``champion``, higher is better: ``heldout_accuracy`` (the final model's
    #: exact match on the held-out prompts) or ``eval_exact_match`` (the last periodic evaluation's)
    champion_metric: Literal["heldout_accuracy", "eval_exact_match"] = "heldout_accuracy"
    #: a version takes ``champion`` only with ``champion_metric`` at least this (the first one too); null: no floor
    champion_min: Float | None = Field(default=None, ge=0, le=1)

"""The job: one training run's lifecycle as the orchestrator drives it (issue 28 §3), above the engine.

Each phase of ``flows/train.py`` is a function here — prepare the run (:mod:`.prepare`), run the attempts
(:mod:`.attempts`), finish (:mod:`.finish`) — and so is the work each Prefect task in ``tasks/`` wraps (launching
an attempt, recovering from a failed one, checkpoints, placement, data validation, the model's export). The
Prefect tasks the phases call are handed in (:class:`~kuangchao_core.job.steps.JobSteps`), so the flow run still
shows each one as a task run.

May import: every ``kuangchao_core`` package; never ``tasks``, ``flows``, ``blocks`` or ``kuangchao``.
"""

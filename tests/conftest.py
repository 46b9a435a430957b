import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# the operator key jobs trust and `kc config set` signs with: the session's own, never the user's
os.environ.setdefault("KC_OPERATOR_KEY", str(Path(tempfile.mkdtemp(prefix="kc-operator-")) / "operator.key"))

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import fixtures, tiers  # noqa: E402  (needs ROOT on sys.path)

# the lifecycle fixtures (session_store, reference_run) and slurm_cluster: fixtures of every test module, no imports
pytest_plugins = ["tests.conftest_prefect", "tests.conftest_slurm"]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier (tests/tiers.py); stop the session naming each test without exactly one."""
    problems = []
    for item in items:
        explicit = [m.name for m in item.iter_markers() if m.name in tiers.TIERS]
        name = getattr(item, "originalname", item.name)
        try:
            tier = tiers.tier_of(item.path.name, name, explicit, getattr(item, "fixturenames", []))
        except tiers.TierError as e:
            problems.append(str(e))
            continue
        if tier == "unit" and item.get_closest_marker("slow") is not None:
            problems.append(f"{item.path.name}::{name} is marked slow but its tier is unit: give it another tier")
        if not explicit:
            item.add_marker(getattr(pytest.mark, tier))
    if problems:
        raise pytest.UsageError("tests without exactly one tier (see tests/tiers.py):\n  " + "\n  ".join(problems))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # on workers (TEST_WORKERS=2): the longest files first
        items.sort(key=lambda item: tiers.run_order(item.path.name))  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One temporary Prefect server (own PREFECT_HOME and database) for the whole session; yields its API URL."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect_home"))
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()
        _drain_prefect_workers(timeout_s=15.0)


def _drain_prefect_workers(timeout_s: float) -> None:
    """Prefect's log and event workers drained within ``timeout_s`` (stopped either way): the harness's own drain
    waits without a bound: it hung 300 s at the end of a loaded two-worker session (what is left unsent is logs)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


def _prefect_console_on_a_live_stream() -> None:
    """Prefect's console handler keeps the stderr of the moment Prefect set its logging up; when that was inside a
    command a test ran in-process (click's CliRunner swaps stderr and closes its own afterwards), every later Prefect
    log line in this worker fails with "I/O operation on closed file". Such a handler is pointed at today's stderr."""
    import logging

    if "prefect.logging.handlers" not in sys.modules:
        return
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for handler in {h for lg in loggers for h in lg.handlers if type(h).__name__ == "PrefectConsoleHandler"}:
        if getattr(handler.stream, "closed", False):
            # Not ``setStream``: it flushes the old stream first, which raises on a closed file.
            with handler.lock:
                handler.stream = sys.stderr
            handler.console.file = sys.stderr


@pytest.fixture(scope="module", autouse=True)
def prefect_console_before_module_fixtures():
    """See :func:`_prefect_console_on_a_live_stream` (before a module's fixtures, which may run flows)."""
    _prefect_console_on_a_live_stream()


@pytest.fixture(autouse=True)
def prefect_console_before_each_test():
    """See :func:`_prefect_console_on_a_live_stream`."""
    _prefect_console_on_a_live_stream()


@pytest.fixture
def trusted():
    """The trusted guard (``AllowAll``) installed for the whole process while the test runs, as the orchestrator
    runs in-process storage, data and recovery calls (no token); the previous guard is put back after. A module
    whose every test needs it says ``pytestmark = pytest.mark.usefixtures("trusted")``."""
    from kuangchao_core.perm import guard_api

    previous = guard_api.install_guard(guard_api.AllowAll())
    yield
    guard_api.install_guard(previous)


@pytest.fixture
def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (more in one test: ``tests.fixtures.free_port()``)."""
    return fixtures.free_port()


@pytest.fixture
def tiny_model():
    """The tests' tiny ``LlamaConfig``; call it with field changes: ``tiny_model(num_layers=4)``."""
    return fixtures.tiny_llama


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server over HTTP for the test module (its own, so buckets never leak between modules); its URL."""
    with fixtures.moto_server() as endpoint:
        yield endpoint

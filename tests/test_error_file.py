"""A rank's error file is whole or absent (``sched/error_file.py``): torchrun's agent ``json.load``s it, and a file
cut by the agent's SIGTERM mid-write used to end the agent on ``JSONDecodeError`` with no failure report (seen as
``torchrun exited with code 1 without a worker failure report`` when a peer rank was SIGKILLed).

The kill mid-write is simulated by a ``json.dump`` that dies after its first chunk; the control is torch's own
handler, which leaves the cut file behind.
"""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from kuangchao_core.sched.error_file import AtomicErrorHandler


class Killed(BaseException):
    """The SIGTERM that ends a rank while it writes."""


def _record(handler: ErrorHandler) -> None:
    try:
        raise RuntimeError("Connection reset by peer")
    except RuntimeError as exc:
        handler.record_exception(exc)


def test_the_error_file_is_whole(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    _record(AtomicErrorHandler())
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "RuntimeError: Connection reset by peer"
    assert "Traceback" in data["message"]["extraInfo"]["py_callstack"]
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


@pytest.mark.parametrize("handler", [AtomicErrorHandler, ErrorHandler], ids=["atomic", "torch-negative-control"])
def test_a_write_cut_short_leaves_no_file_the_agent_cannot_read(tmp_path, monkeypatch, handler):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def dump(obj, fp, **kwargs):
        fp.write(json.dumps(obj)[:10])
        raise Killed

    monkeypatch.setattr(json, "dump", dump)
    with pytest.raises(Killed):
        _record(handler())
    if handler is AtomicErrorHandler:
        assert not path.exists()  # the agent finds no error file: it reports the rank's signal or exit code
    else:
        with pytest.raises(json.JSONDecodeError):  # what the agent met
            json.loads(path.read_text())

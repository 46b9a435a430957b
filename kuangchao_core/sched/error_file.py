"""A rank's error file written whole or not at all.

torchrun's agent reads each failed rank's error file (``TORCHELASTIC_ERROR_FILE``) with ``json.load`` when it
builds its failure report. torch's own handler writes the file in place, so a rank that the agent stops while it
is writing (its peer was killed, the rank's collective raised, and the agent's SIGTERM came mid-write) leaves an
empty or cut file, and the agent itself dies on ``JSONDecodeError`` with no report: the job then cannot say which
rank died or why. :class:`AtomicErrorHandler` writes the same JSON to a temporary file beside it and renames it
into place.
"""

from __future__ import annotations

import json
import os
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler


class AtomicErrorHandler(ErrorHandler):
    """torch's error handler, its error file replaced atomically (see the module docstring)."""

    def record_exception(self, e: BaseException) -> None:
        """Write the exception as torch's handler does (``message``, ``extraInfo``), atomically."""
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
            }
        }
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fp:
            json.dump(data, fp)
        os.replace(tmp, path)

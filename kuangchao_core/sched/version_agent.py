"""The doctor's version agent: a node answers each TCP connection with one JSON line of its versions (no ssh).

Run on a node with ``kc doctor --serve`` (or ``python -m kuangchao_core.sched.doctor --serve``); ``kc doctor``
on the orchestrator connects to every configured node and compares torch/CUDA/NCCL/Python versions. A node written
``host:port`` uses that port; others use ``KC_DOCTOR_PORT`` (29411).
"""

from __future__ import annotations

import json
import os
import platform
import socket
from typing import Any

DEFAULT_AGENT_PORT = int(os.environ.get("KC_DOCTOR_PORT", "29411"))
CONNECT_TIMEOUT_S = 3.0
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def local_versions() -> dict[str, Any]:
    """Versions of this machine's Python, torch, CUDA, cuDNN and NCCL (None where absent); ``gpu``: the driver,
    CUDA, NCCL and GPU names, ``"none"`` with reasons where absent (:func:`.gpu_versions.probe_gpu_versions`)."""
    import torch

    from kuangchao_core.sched.gpu_versions import probe_gpu_versions

    out: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": False,
        "nccl": None,
        "cudnn": None,
        "gpus": 0,
        "gpu": probe_gpu_versions(),
    }
    try:
        if torch.cuda.is_available():
            out["cuda_available"] = True
            out["gpus"] = torch.cuda.device_count()
            out["gpu_name"] = torch.cuda.get_device_name(0)
            out["cudnn"] = torch.backends.cudnn.version()
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:  # a broken driver must not crash the doctor
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return out


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine."""
    return host in LOCAL_HOSTS or host in {socket.gethostname(), socket.getfqdn()}


def split_host(spec: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); a bare host gets the agent's default port."""
    if spec.count(":") == 1:
        host, port = spec.split(":")
        return host, int(port)
    return spec, DEFAULT_AGENT_PORT


def tcp_connect(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection succeeds, else the reason it did not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def query_agent(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """Ask the doctor agent on ``host:port`` for its versions (raises ``OSError`` or ``ValueError``)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
            if len(buf) > 65536:
                raise ValueError("agent answer too long")
    return json.loads(buf.decode("utf-8"))


def serve_versions(
    host: str = "0.0.0.0", port: int = DEFAULT_AGENT_PORT, versions: dict | None = None, ready: Any = None
) -> socket.socket:
    """Doctor agent: answer every TCP connection with one JSON line of this node's versions; runs until closed.

    ``ready`` (a ``threading.Event``-like object with ``set``) is set once listening; the socket is returned when
    the server stops (closing it from another thread stops the loop).
    """
    info = dict(versions or local_versions())
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(16)
    if ready is not None:
        ready.port = srv.getsockname()[1]
        ready.sock = srv
        ready.set()
    payload = (json.dumps(info) + "\n").encode()
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return srv
        with conn:
            try:
                conn.sendall(payload)
            except OSError:
                pass

"""``kc doctor``: check that this machine and the configured cluster can run a job (SPEC OPS.1).

Each check gives ``name``, ``ok``, ``detail`` and, when it fails, a ``fix``. The checks:

- ``versions``: Python and torch versions here.
- ``cuda``: CUDA, cuDNN and NCCL versions when CUDA is available; fails only when the config asks for CUDA/NCCL
  and there is none.
- ``gloo``: a real two-process Gloo ``all_reduce`` over loopback, in fresh subprocesses, with a timeout.
- ``node:<host>``: each configured node answers a TCP connect on its doctor agent port.
- ``version_agreement``: torch/CUDA/NCCL/Python versions reported by the reachable nodes agree with ours.
  A node reports its versions through a tiny TCP agent (``kc doctor --serve`` or
  ``python -m kuangchao_core.sched.doctor --serve``): it answers each connection with one JSON line.
  No ssh is needed. A node written ``host:port`` uses that port; others use ``KC_DOCTOR_PORT`` (29411).
  Local-only clusters pass trivially.
- ``checkpoint_storage``: a local ``checkpoint.dir`` accepts a write+fsync+delete of a probe file; an
  ``s3://bucket/prefix`` URI accepts ``head_bucket`` and a put/delete of a probe object (endpoint from
  ``checkpoint.endpoint_url`` or ``AWS_ENDPOINT_URL``, credentials from boto3's usual chain).
- ``mlflow``: a ``sqlite:`` or file store's directory is writable; an ``http(s)`` server answers ``GET /health``.
- ``prefect``: with ``PREFECT_API_URL`` set the server answers ``GET <api>/health``; otherwise the ephemeral
  API is used and the check passes.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.sched.launcher import free_port

DEFAULT_AGENT_PORT = int(os.environ.get("KC_DOCTOR_PORT", "29411"))
CONNECT_TIMEOUT_S = 3.0
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


@dataclass
class Check:
    """One doctor check: ``fix`` says what to do when ``ok`` is false."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class DoctorReport:
    """All checks of one doctor run."""

    checks: list[Check] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if not c.ok]

    def check(self, name: str) -> Check:
        """The check called ``name``."""
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"ok": self.ok, "elapsed_s": round(self.elapsed_s, 3), "checks": [asdict(c) for c in self.checks]}

    def to_markdown(self) -> str:
        """Markdown table (for a Prefect artifact)."""
        lines = [
            f"# kc doctor: {'all checks passed' if self.ok else f'{len(self.failed)} check(s) FAILED'}",
            "",
            "| check | result | detail | fix |",
            "|---|---|---|---|",
        ]
        for c in self.checks:
            cells = [c.name, "ok" if c.ok else "**FAIL**", c.detail, c.fix if not c.ok else ""]
            lines.append("| " + " | ".join(x.replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ helpers


def local_versions() -> dict[str, Any]:
    """Versions of this machine's Python, torch, CUDA, cuDNN and NCCL (None where absent)."""
    import torch

    out: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": False,
        "nccl": None,
        "cudnn": None,
        "gpus": 0,
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


def _is_local(host: str) -> bool:
    return host in LOCAL_HOSTS or host in {socket.gethostname(), socket.getfqdn()}


def _split_host(spec: str) -> tuple[str, int]:
    if spec.count(":") == 1:
        host, port = spec.split(":")
        return host, int(port)
    return spec, DEFAULT_AGENT_PORT


def _tcp_connect(host: str, port: int, timeout: float) -> str | None:
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


# ------------------------------------------------------------------------------------------------ checks


def check_versions() -> Check:
    """Python and torch versions."""
    v = local_versions()
    return Check("versions", True, f"python {v['python']}, torch {v['torch']} on {v['hostname']}")


def check_cuda(cfg: Any = None) -> Check:
    """CUDA/NCCL versions when CUDA is available; fail only when the config needs CUDA and it is absent."""
    v = local_versions()
    wants_cuda = setting(cfg, "train.device") == "cuda" or setting(cfg, "parallel.backend") == "nccl"
    if v["cuda_available"]:
        return Check(
            "cuda",
            True,
            f"CUDA {v['cuda']}, cuDNN {v['cudnn']}, NCCL {v['nccl']}, {v['gpus']} x {v.get('gpu_name', 'GPU')}",
        )
    if wants_cuda:
        why = v.get("cuda_error") or f"torch {v['torch']} built with CUDA {v['cuda']}, no usable GPU"
        return Check(
            "cuda",
            False,
            f"config asks for CUDA/NCCL but CUDA is not available ({why})",
            "install a CUDA build of torch and the NVIDIA driver, or set train.device: cpu and parallel.backend: gloo",
        )
    return Check("cuda", True, f"CUDA not available (CPU build or no GPU; torch CUDA {v['cuda']}); Gloo will be used")


_GLOO_PROBE = textwrap.dedent(
    """
    import sys, datetime
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(sys.argv[4])))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    print(repr(t.tolist()))
    """
)


def check_gloo(timeout_s: float = 60.0, world_size: int = 2) -> Check:
    """A real ``world_size``-process Gloo all_reduce over loopback."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_PROBE, str(r), str(world_size), str(port), str(timeout_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world_size)
    ]
    outs: list[tuple[int | None, str, str]] = []
    deadline = t0 + timeout_s
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.communicate()
            return Check(
                "gloo",
                False,
                f"{world_size}-process Gloo all_reduce on 127.0.0.1:{port} did not finish in {timeout_s:.0f} s",
                "check that loopback TCP works and no firewall blocks local ports; set GLOO_SOCKET_IFNAME=lo",
            )
    expected = [float(world_size * (world_size + 1) // 2)] * 4
    for rank, (rc, out, err) in enumerate(outs):
        if rc != 0 or out.strip() != repr(expected):
            tail = (err.strip().splitlines() or ["no output"])[-1]
            return Check(
                "gloo",
                False,
                f"Gloo all_reduce failed on rank {rank} (exit {rc}): {tail}",
                "reinstall torch with distributed support; set GLOO_SOCKET_IFNAME to a working interface (lo)",
            )
    return Check("gloo", True, f"{world_size}-process all_reduce ok in {time.monotonic() - t0:.1f} s")


def configured_nodes(cfg: Any) -> list[str]:
    """Hosts of ``cluster.nodes`` (empty for a local cluster)."""
    nodes = setting(cfg, "cluster.nodes", []) or []
    hosts = []
    for n in nodes:
        host = n.get("host") if isinstance(n, dict) else getattr(n, "host", None)
        if host:
            hosts.append(str(host))
    return hosts


def check_nodes(cfg: Any, timeout: float = CONNECT_TIMEOUT_S) -> tuple[list[Check], Check]:
    """Reachability of every configured node, and agreement of their versions with ours."""
    mine = local_versions()
    keys = ("python", "torch", "cuda", "nccl")
    reports: dict[str, dict] = {}
    checks: list[Check] = []
    unreachable: list[str] = []
    remote = [h for h in configured_nodes(cfg) if not _is_local(_split_host(h)[0])]
    for spec in configured_nodes(cfg):
        host, port = _split_host(spec)
        if _is_local(host):
            reports[spec] = mine
            checks.append(Check(f"node:{spec}", True, "this machine"))
            continue
        err = _tcp_connect(host, port, timeout)
        if err is not None:
            unreachable.append(spec)
            checks.append(
                Check(
                    f"node:{spec}",
                    False,
                    f"no TCP connection to {host}:{port} within {timeout:g} s ({err})",
                    f"check that {host} is up and resolvable, start `kc doctor --serve --port {port}` there, "
                    f"and open TCP port {port} (and the rendezvous port) in its firewall",
                )
            )
            continue
        try:
            reports[spec] = query_agent(host, port, timeout)
            checks.append(Check(f"node:{spec}", True, f"{host}:{port} reachable ({reports[spec].get('hostname')})"))
        except (OSError, ValueError) as exc:
            unreachable.append(spec)
            checks.append(
                Check(
                    f"node:{spec}",
                    False,
                    f"{host}:{port} accepts connections but is not a kc doctor agent ({exc})",
                    f"start `kc doctor --serve --port {port}` on {host}, or name its agent port as {host}:PORT",
                )
            )
    if not remote:
        return checks, Check("version_agreement", True, "local cluster: nothing to compare")
    if not any(_is_local(_split_host(h)[0]) for h in reports):  # the launching machine counts too
        reports["(this machine)"] = mine
    differ = {}
    for k in keys:
        vals = {spec: r.get(k) for spec, r in reports.items()}
        if len(set(map(str, vals.values()))) > 1:
            differ[k] = vals
    skipped = f"; not compared (unreachable): {', '.join(unreachable)}" if unreachable else ""
    if differ:
        detail = "; ".join(f"{k}: " + ", ".join(f"{h}={v}" for h, v in vals.items()) for k, vals in differ.items())
        return checks, Check(
            "version_agreement",
            False,
            f"versions differ across nodes: {detail}{skipped}",
            "install the same Python, torch, CUDA and NCCL on every node (same container image or lock file)",
        )
    agreed = ", ".join(f"{k} {mine.get(k)}" for k in keys)
    return checks, Check("version_agreement", True, f"{len(reports)} nodes agree: {agreed}{skipped}")


def _probe_local_dir(path: Path) -> Check:
    created: list[Path] = []
    try:
        missing = path
        while not missing.exists() and missing.parent != missing:
            created.append(missing)
            missing = missing.parent
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".kc-doctor-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"kc doctor probe\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        for d in created:  # leave the tree as it was; the job creates its directories itself
            d.rmdir()
        return Check("checkpoint_storage", True, f"{path} writable (write+fsync+delete)")
    except OSError as exc:
        return Check(
            "checkpoint_storage",
            False,
            f"cannot write to checkpoint dir {path}: {type(exc).__name__}: {exc}",
            "set checkpoint.dir to a writable directory (shared by all nodes for multi-node jobs), "
            "or fix its permissions / free space",
        )


def _probe_s3(uri: str, endpoint: str | None) -> Check:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    where = f"{uri}" + (f" at {endpoint}" if endpoint else "")
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=10, retries={"max_attempts": 1}),
        )
        s3.head_bucket(Bucket=bucket)
        key = f"{prefix.rstrip('/') + '/' if prefix else ''}.kc-doctor-{uuid.uuid4().hex}"
        s3.put_object(Bucket=bucket, Key=key, Body=b"kc doctor probe\n")
        s3.delete_object(Bucket=bucket, Key=key)
        return Check("checkpoint_storage", True, f"{where} writable (head_bucket + put/delete)")
    except (BotoCoreError, ClientError) as exc:
        return Check(
            "checkpoint_storage",
            False,
            f"S3 checkpoint storage {where} not usable: {type(exc).__name__}: {exc}",
            "check that the bucket exists, the endpoint (checkpoint.endpoint_url / AWS_ENDPOINT_URL) is right, and "
            "the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the storage block) allow put and delete",
        )


def check_checkpoint_storage(cfg: Any) -> Check:
    """The configured checkpoint storage (local directory or S3) accepts writes."""
    uri = setting(cfg, "checkpoint.uri")
    if uri and str(uri).startswith("s3://"):
        endpoint = setting(cfg, "checkpoint.endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
        return _probe_s3(str(uri), endpoint)
    return _probe_local_dir(Path(str(setting(cfg, "checkpoint.dir", "checkpoints"))).expanduser())


def _http_health(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            if 200 <= resp.status < 300:
                return None
            return f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def check_mlflow(cfg: Any, timeout: float = CONNECT_TIMEOUT_S) -> Check:
    """The MLflow tracking store is reachable (sqlite/file: directory writable; http: ``/health``)."""
    uri = str(setting(cfg, "tracking.uri", None) or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    fix_dir = "set tracking.uri to a location you can write, e.g. sqlite:///mlflow.db in the working directory"
    if uri.startswith("sqlite:"):
        path = uri.split("sqlite:///", 1)[1] if "sqlite:///" in uri else ""
        if path in ("", ":memory:"):
            return Check("mlflow", True, f"{uri}: in-memory store")
        directory = Path(path).expanduser().resolve().parent
    elif uri.startswith(("http://", "https://")):
        err = _http_health(uri.rstrip("/") + "/health", timeout)
        if err is None:
            return Check("mlflow", True, f"{uri} healthy")
        return Check(
            "mlflow",
            False,
            f"MLflow server {uri} not reachable: {err}",
            "start it (`mlflow server --host 0.0.0.0 --port 5000`) or fix tracking.uri / MLFLOW_TRACKING_URI",
        )
    elif uri.startswith("file:") or "://" not in uri:
        directory = Path(uri.split("file://", 1)[-1]).expanduser().resolve()
    else:
        return Check("mlflow", True, f"{uri}: scheme not probed by the doctor")
    if not directory.exists():
        return Check("mlflow", False, f"directory {directory} of {uri} does not exist", fix_dir)
    if not os.access(directory, os.W_OK):
        return Check("mlflow", False, f"directory {directory} of {uri} is not writable", fix_dir)
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kc-doctor-"):
            pass
    except OSError as exc:
        return Check("mlflow", False, f"cannot create files in {directory}: {exc}", fix_dir)
    return Check("mlflow", True, f"{uri}: {directory} writable")


def check_prefect(timeout: float = CONNECT_TIMEOUT_S) -> Check:
    """The Prefect API named by ``PREFECT_API_URL`` answers ``/health``; without it the ephemeral API is used."""
    api = os.environ.get("PREFECT_API_URL")
    if not api and "prefect" in sys.modules:  # a profile or an active test harness may set it
        try:
            from prefect.settings import get_current_settings

            api = get_current_settings().api.url
        except Exception:
            api = None
    if not api:
        return Check("prefect", True, "PREFECT_API_URL not set: flows use Prefect's ephemeral local API")
    err = _http_health(api.rstrip("/") + "/health", timeout)
    if err is None:
        return Check("prefect", True, f"{api} healthy")
    return Check(
        "prefect",
        False,
        f"Prefect API {api} not reachable: {err}",
        "start the server (`prefect server start`) or unset PREFECT_API_URL to use the ephemeral API",
    )


def _guarded(name: str, fn: Callable[[], Any]) -> list[Check]:
    try:
        out = fn()
    except Exception as exc:  # a check that crashes is a failed check, never a crashed doctor
        return [Check(name, False, f"check raised {type(exc).__name__}: {exc}", "report this as a kc doctor bug")]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def run_doctor(cfg: Any = None, *, gloo_timeout_s: float = 60.0, skip: Sequence[str] = ()) -> DoctorReport:
    """Run every check against ``cfg`` (a ``JobConfig``, a similar object, or None for defaults)."""
    t0 = time.monotonic()
    report = DoctorReport()

    def nodes() -> list[Check]:
        node_checks, agreement = check_nodes(cfg)
        return [*node_checks, agreement]

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("versions", check_versions),
        ("cuda", lambda: check_cuda(cfg)),
        ("gloo", lambda: check_gloo(gloo_timeout_s)),
        ("nodes", nodes),
        ("checkpoint_storage", lambda: check_checkpoint_storage(cfg)),
        ("mlflow", lambda: check_mlflow(cfg)),
        ("prefect", check_prefect),
    ]
    for name, fn in steps:
        if name not in skip:
            report.checks.extend(_guarded(name, fn))
    report.elapsed_s = time.monotonic() - t0
    return report


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kuangchao_core.sched.doctor")
    ap.add_argument("--serve", action="store_true", help="run the version agent on this node")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=DEFAULT_AGENT_PORT)
    args = ap.parse_args(argv)
    if args.serve:
        print(f"kc doctor agent listening on {args.host}:{args.port}", flush=True)
        serve_versions(args.host, args.port)
        return 0
    report = run_doctor()
    print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

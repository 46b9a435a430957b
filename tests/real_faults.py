"""Real failures, caught as the code under test would meet them (issue 44 item 4): each helper provokes the fault
for real — a connection to a closed port, a bind to a held port, a SQLite write lock held by another connection,
an S3 client against an endpoint that refuses or never answers — and returns the exception it raised."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.fixtures import free_port

ROOT = Path(__file__).resolve().parent.parent


def caught(fn: Callable[[], object]) -> BaseException:
    """The exception ``fn()`` raises (an AssertionError when it raises none)."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the fault is the point
        return exc
    raise AssertionError(f"{fn} raised nothing")


def refused_connection() -> BaseException:
    """``ConnectionRefusedError``: a TCP connect to a port nothing listens on."""
    return caught(lambda: socket.create_connection(("127.0.0.1", free_port()), timeout=2))


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port bound and listened on for the duration (a bind to it meets EADDRINUSE); released afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def address_in_use() -> BaseException:
    """``OSError(EADDRINUSE)``: a bind to a port another socket holds."""
    with held_port() as port, socket.socket() as s:
        return caught(lambda: s.bind(("127.0.0.1", port)))


def socket_timeout() -> BaseException:
    """``TimeoutError``: a read from a peer that accepted the connection and never answers."""
    with held_port() as port, socket.create_connection(("127.0.0.1", port), timeout=2) as c:
        c.settimeout(0.05)
        return caught(lambda: c.recv(1))


@contextlib.contextmanager
def write_locked(db: Path) -> Iterator[None]:
    """``db`` (a SQLite file) write-locked by another connection (``BEGIN EXCLUSIVE``) for the duration."""
    holder = sqlite3.connect(db, timeout=0, isolation_level=None)
    holder.execute("CREATE TABLE IF NOT EXISTS t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def sqlite_locked(db: Path) -> BaseException:
    """``sqlite3.OperationalError('database is locked')``: a write while another connection holds the lock."""
    with write_locked(db):
        con = sqlite3.connect(db, timeout=0)
        try:
            return caught(lambda: con.execute("INSERT INTO t VALUES (1)"))
        finally:
            con.close()


def store_locked(db: Path) -> BaseException:
    """``TrackingStoreError`` of kind ``locked``: the tracking store's own call, with no wait, on a locked store."""
    from kuangchao_core.obs import tracking_store

    def write() -> None:
        con = sqlite3.connect(db, timeout=0)
        try:
            con.execute("INSERT INTO t VALUES (1)")
        finally:
            con.close()

    with write_locked(db):
        return caught(lambda: tracking_store.call(f"sqlite:///{db}", write, wait_s=0.0))


def url_refused() -> BaseException:
    """``urllib.error.URLError`` around a refused connection (an HTTP client over a closed port)."""
    import urllib.request

    return caught(lambda: urllib.request.urlopen(f"http://127.0.0.1:{free_port()}/health", timeout=2))


def s3_client(endpoint: str, read_timeout: float = 2.0):
    """A boto3 S3 client against ``endpoint`` that tries once."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=1, read_timeout=read_timeout, retries={"max_attempts": 1})
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="kc",
        aws_secret_access_key="kc-test",
        config=config,
    )


def s3_refused() -> BaseException:
    """botocore ``EndpointConnectionError``: an S3 endpoint on a closed port."""
    client = s3_client(f"http://127.0.0.1:{free_port()}")
    return caught(lambda: client.head_bucket(Bucket="kc"))


def s3_read_timeout() -> BaseException:
    """botocore ``ReadTimeoutError``: an S3 endpoint that accepts the connection and never answers."""
    with held_port() as port:
        client = s3_client(f"http://127.0.0.1:{port}", read_timeout=0.2)
        return caught(lambda: client.head_bucket(Bucket="kc"))


def httpx_refused() -> BaseException:
    """``httpx.ConnectError``: an HTTP API (Prefect's client library) on a closed port."""
    import httpx

    return caught(lambda: httpx.get(f"http://127.0.0.1:{free_port()}/api/health", timeout=2))


def config_error() -> BaseException:
    """``ConfigError``: the real loader given a value its schema refuses."""
    from kuangchao_core.config import load_config

    return caught(lambda: load_config(ROOT / "configs" / "tiny.yaml", ["train.steps=-3"]))


def permission_denied() -> BaseException:
    """``PermissionDenied``: the default-deny guard of a process without a token."""
    from kuangchao_core.guard_api import DenyAll

    return caught(lambda: DenyAll().check("fs.write", "/tmp/kc"))


def not_publishable() -> BaseException:
    """``NotPublishable``: the publishing gate given a run whose final loss is NaN."""
    from kuangchao_core.obs.publish_gate import check_publishable

    return caught(lambda: check_publishable(None, float("nan")))

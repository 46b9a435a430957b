"""An authenticating gate in front of a multi-host job's c10d store (issue 38 item 2).

torch's ``TCPStore`` protocol has no authentication. In a multi-host job the store itself listens on node 0's
loopback only; a :class:`Gate` listens on the training interface and lets a connection through to the store only
after a challenge-response on the job's secret key, and on every other node a :class:`Relay` listens on that
node's loopback and carries each local connection (the agent's, the ranks') through the gate. A process that does
not hold the key — on another host, in another network namespace — is cut off before its first store byte.

The handshake (each side's proof binds both nonces, so nothing recorded can be replayed)::

    gate  -> client  MAGIC + 32-byte nonce_g
    client -> gate   32-byte nonce_c + HMAC-SHA256(key, "kc-store-client" + nonce_g + nonce_c)
    gate  -> client  HMAC-SHA256(key, "kc-store-gate" + nonce_g + nonce_c)     (only when the client's proof holds)

then both connections are spliced until either side closes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time

from kuangchao_core.sched.store_key import ENV_KEY_FILE, new_key, read_key_file  # noqa: F401 - new_key: the API

MAGIC = b"KCSG1"
NONCE = 32
MAC = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT_S = 10.0
ENV_KEY = "KC_STORE_KEY"  # hex; the launcher takes it out of the environment and hands it to torchrun by pipe
ENV_KEY_FD = "KC_STORE_KEY_FD"

log = logging.getLogger(__name__)


class GateRefused(ConnectionError):
    """The other side does not hold the job's store key (or does not speak the gate's handshake)."""


def bind_env(env: dict[str, str], single_host: bool) -> int | None:
    """Set a launch's ``env`` for where its ranks listen and connect (issue 38 item 2); returns the read end of a
    pipe holding the job's store key for torchrun (pass it with ``pass_fds``, close it after), or None.

    The ranks are clients of the agent's store (``kc-c10d`` binds it to one address), so none of them hosts one
    (each attempt is a fresh torchrun: no stale keys carry over, pytorch#135712 needs a restart in one torchrun). A
    single-host job's Gloo (and NCCL bootstrap) sockets are on loopback. The key (``KC_STORE_KEY``, or a multi-host
    attempt's ``KC_STORE_KEY_FILE``, :mod:`~kuangchao_core.sched.store_key`) leaves ``env``: torchrun reads it from
    the pipe (``KC_STORE_KEY_FD``) before any rank starts, so no rank's environment holds it."""
    from kuangchao_core.sched.bind_address import LOOPBACK_IFNAME

    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"
    if single_host:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    key, key_file = env.pop(ENV_KEY, ""), env.pop(ENV_KEY_FILE, "")
    if not key and key_file and not single_host:
        key = read_key_file(key_file)  # a multi-host attempt's key (node agents, Slurm nodes)
    if not key:
        return None
    r, w = os.pipe()
    try:
        os.write(w, key.encode("ascii") + b"\n")  # a few dozen bytes: the pipe's buffer takes them at once
    finally:
        os.close(w)
    env[ENV_KEY_FD] = str(r)
    return r


def _mac(key: bytes, label: bytes, nonce_g: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(key, label + nonce_g + nonce_c, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise GateRefused("connection closed during the store handshake")
        buf += chunk
    return buf


def admit(sock: socket.socket, key: bytes) -> None:
    """The gate's side of the handshake on an accepted ``sock``; raises ``GateRefused`` (or ``OSError``)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    nonce_g = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nonce_g)
    answer = _recv_exact(sock, NONCE + MAC)
    nonce_c, proof = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"kc-store-client", nonce_g, nonce_c)):
        raise GateRefused("the client's proof does not match the job's store key")
    sock.sendall(_mac(key, b"kc-store-gate", nonce_g, nonce_c))
    sock.settimeout(None)


def enter(sock: socket.socket, key: bytes) -> None:
    """The client's side of the handshake on a connected ``sock``; raises ``GateRefused`` (or ``OSError``)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    hello = _recv_exact(sock, len(MAGIC) + NONCE)
    if hello[: len(MAGIC)] != MAGIC:
        raise GateRefused("the other side is no store gate")
    nonce_g, nonce_c = hello[len(MAGIC) :], secrets.token_bytes(NONCE)
    sock.sendall(nonce_c + _mac(key, b"kc-store-client", nonce_g, nonce_c))
    if not hmac.compare_digest(_recv_exact(sock, MAC), _mac(key, b"kc-store-gate", nonce_g, nonce_c)):
        raise GateRefused("the gate's proof does not match the job's store key")
    sock.settimeout(None)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    for s in (src, dst):  # one side gone: end both directions
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between ``a`` and ``b`` in two daemon threads; both close when either side does."""

    def run(src: socket.socket, dst: socket.socket, closer: bool) -> None:
        _pump(src, dst)
        if closer:
            other.join()
            a.close()
            b.close()

    other = threading.Thread(target=_pump, args=(b, a), daemon=True)
    other.start()
    threading.Thread(target=run, args=(a, b, True), daemon=True).start()


class _Listener:
    """A listening socket whose connections are served on threads of their own until :meth:`close`."""

    def __init__(self, host: str, port: int, name: str):
        from kuangchao_core.sched.bind_address import numeric_address

        addr = numeric_address(host)
        self.sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((addr, port))
            self.sock.listen(256)
        except BaseException:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]
        self.refused = 0
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop accepting (connections already through stay up until their ends close)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Gate(_Listener):
    """Listens on ``host:port`` and splices each connection that proves the ``key`` to ``target`` (the store on
    loopback); any other connection is closed before it reaches the store."""

    def __init__(self, host: str, port: int, target: tuple[str, int], key: bytes):
        self.target, self.key = target, key
        super().__init__(host, port, "kc-store-gate")

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            admit(conn, self.key)
            upstream = socket.create_connection(self.target, timeout=HANDSHAKE_TIMEOUT_S)
            upstream.settimeout(None)
        except (OSError, GateRefused) as exc:
            self.refused += 1
            log.warning("store gate: refused %s (%s)", peer[0], exc)
            conn.close()
            return
        splice(conn, upstream)


class Relay(_Listener):
    """Listens on this node's loopback and carries each connection through the :class:`Gate` at ``gate``."""

    def __init__(self, gate: tuple[str, int], key: bytes, host: str = "127.0.0.1", connect_wait_s: float = 60.0):
        self.gate, self.key, self.connect_wait_s = gate, key, connect_wait_s
        super().__init__(host, 0, "kc-store-relay")

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            upstream = self._through()
        except (OSError, GateRefused) as exc:
            log.warning("store relay: no way through the gate at %s:%s (%s)", *self.gate, exc)
            conn.close()
            return
        splice(conn, upstream)

    def _through(self) -> socket.socket:
        """A connection past the gate; a gate not up yet (refused) is retried for ``connect_wait_s``."""
        deadline = time.monotonic() + self.connect_wait_s
        while True:
            try:
                upstream = socket.create_connection(self.gate, timeout=HANDSHAKE_TIMEOUT_S)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        try:
            enter(upstream, self.key)
        except BaseException:
            upstream.close()
            raise
        return upstream

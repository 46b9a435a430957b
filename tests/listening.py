"""The TCP sockets a set of processes listens on, read from ``/proc`` (Linux): ``(pid, address, port)``; and the check
that a running multi-host job's store is gated (issue 38 item 2)."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path


def _address(field: str) -> tuple[str, int]:
    """``0100007F:8AA5`` (``/proc/net/tcp``'s hex, host byte order per 32-bit word) as ``("127.0.0.1", 35493)``."""
    hexip, hexport = field.split(":")
    raw = bytes.fromhex(hexip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(hexport, 16)


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """Every TCP socket (IPv4 and IPv6) in the LISTEN state that one of ``pids`` holds open."""
    found = set()
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: TCP_LISTEN
                    found.add((pid, *_address(cols[1])))
    return sorted(found)


def exposed(listeners: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """The listeners reachable from beyond this host's loopback: on a wildcard or any non-loopback address."""
    return [entry for entry in listeners if not ipaddress.ip_address(entry[1]).is_loopback]


def assert_store_gated(runs: Path, pids: list[int], host: str) -> None:
    """Issue 38 item 2: a running multi-host job (ranks ``pids``, its run directory under ``runs``) answers only its
    key. The attempt's key is in a 0600 file and in no rank's environment; on ``host`` (node 0's training address)
    the job's torchrun listens only with the gate, and a store client that knows the port cannot write a key through
    it (an ungated store would take the write)."""
    import stat
    from datetime import timedelta

    import pytest
    import torch.distributed as dist

    [key_file] = list(runs.glob("**/tokens/attempt_0.store_key"))
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip().encode()
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert key not in environ and b"KC_STORE_KEY" not in environ, f"rank pid {pid} holds the store key"
    agents = sorted({int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in pids})
    ports = sorted({port for _, addr, port in listening(agents) if addr == host})
    assert ports, listening(agents)
    for port in ports:
        with pytest.raises(Exception):  # noqa: B017 - torch raises its own DistNetworkError / RuntimeError
            dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5)).set("kc-probe", "planted")

"""Job accounting for a Slurm lab, so that ``sacct`` shows its jobs: slurmdbd on a private MariaDB server.

Debian's Slurm 22.05 keeps job records only through slurmdbd, and slurmdbd stores them only in MySQL/MariaDB
(``accounting_storage/mysql``; the old text-file storage is gone, and ``sacct --completion`` reads another
record). So each lab runs its own ``mariadbd`` — an empty data directory in the lab's, ``127.0.0.1`` on a free
port, no grant tables (nothing but this lab's slurmdbd reaches it), InnoDB tuned for a throw-away store — and its
own ``slurmdbd`` on another free port, which creates its tables on first start. Both start in well under a second;
creating the tables takes a few. The machine's own ``/etc/mysql`` and ``/etc/slurm`` are never read
(``--no-defaults``, ``SLURM_CONF``).
"""

from __future__ import annotations

import os
from pathlib import Path

COMMANDS = ("mariadbd", "slurmdbd")


def mariadbd_argv(directory: Path, port: int) -> list[str]:
    """The command line of the lab's MariaDB server (data, socket and logs under ``directory``)."""
    return [
        "mariadbd",
        "--no-defaults",  # first: no /etc/mysql option file
        f"--datadir={directory / 'data'}",
        f"--socket={directory / 'mysqld.sock'}",
        f"--pid-file={directory / 'mysqld.pid'}",
        f"--tmpdir={directory}",
        f"--log-error={directory / 'mysqld.err'}",
        "--bind-address=127.0.0.1",
        f"--port={port}",
        "--skip-grant-tables",
        "--skip-name-resolve",
        "--skip-log-bin",
        "--user=root",
        "--innodb-buffer-pool-size=32M",
        "--innodb-log-file-size=8M",
        "--innodb-flush-log-at-trx-commit=0",
        "--innodb-doublewrite=0",
        "--innodb-use-native-aio=0",
    ]


def write_slurmdbd_conf(slurm_conf: Path, *, munge_socket: Path, dbd_port: int, db_port: int, run: Path) -> Path:
    """Write ``slurmdbd.conf`` next to ``slurm_conf`` (slurmdbd looks for it there); mode 0600 as slurmdbd demands."""
    path = slurm_conf.with_name("slurmdbd.conf")
    path.write_text(
        "\n".join(
            [
                "AuthType=auth/munge",
                f"AuthInfo=socket={munge_socket}",
                "DbdHost=localhost",
                f"DbdPort={dbd_port}",
                "SlurmUser=root",
                f"PidFile={run / 'slurmdbd.pid'}",
                f"LogFile={run.parent / 'log' / 'slurmdbd.log'}",
                "DebugLevel=info",
                "StorageType=accounting_storage/mysql",
                "StorageHost=127.0.0.1",
                f"StoragePort={db_port}",
                "StorageUser=root",
                "StorageLoc=slurm_acct_db",
                "",
            ]
        )
    )
    os.chmod(path, 0o600)
    return path


def slurm_conf_lines(address: str, dbd_port: int, munge_socket: Path) -> list[str]:
    """The accounting lines of ``slurm.conf``: job records to the lab's slurmdbd at ``address``:``dbd_port``,
    authenticated by the lab's munged (``AccountingStoragePass`` names its socket; ``AuthInfo`` does not cover
    this connection)."""
    return [
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={address}",
        f"AccountingStoragePort={dbd_port}",
        f"AccountingStoragePass={munge_socket}",
        "JobAcctGatherType=jobacct_gather/none",
    ]

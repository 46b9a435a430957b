"""The rendezvous of ``kc launch`` (a user's script under torchrun), bound to where the job needs it (issue 38 item 2).

One node: ``kc-c10d`` on a free loopback port, every store and Gloo socket of the job on loopback. Several nodes:
``kc-static`` (:mod:`~kuangchao_core.sched.bound_static`: each node's rank fixed by ``--node-rank``, as ``kc
launch``'s per-rank tokens need) with node 0's store on ``--master-addr`` only, and behind the gate when the nodes
share a store key (``--store-key-file`` / ``$KC_STORE_KEY_FILE``: the same secret file on every node), which the
launch hands to torchrun by pipe.
"""

from __future__ import annotations

from kuangchao_core.sched.bind_address import LOOPBACK_IFNAME, RDZV_BACKEND
from kuangchao_core.sched.store_gate import bind_env
from kuangchao_core.sched.store_key import ENV_KEY_FILE

STATIC_BACKEND = "kc-static"  # kuangchao_core.sched.bound_static.BACKEND (that module imports torch)


def script_rendezvous(
    nnodes: int, node_rank: int, addr: str, port: int, run_id: str, env: dict[str, str]
) -> tuple[list[str], int | None]:
    """torchrun's rendezvous options for the job and the read end of the pipe holding its store key (pass it to
    torchrun, close it after; None without a key). ``env`` (torchrun's) is set to match; ``port`` of a one-node job
    is a free loopback port."""
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"  # the ranks are clients of torchrun's store
    if nnodes == 1:
        env.pop(ENV_KEY_FILE, None)
        env.update(GLOO_SOCKET_IFNAME=LOOPBACK_IFNAME, NCCL_SOCKET_IFNAME=LOOPBACK_IFNAME)
        rdzv = ["--nnodes", "1", "--rdzv-backend", RDZV_BACKEND, "--rdzv-endpoint", f"127.0.0.1:{port}"]
        return [*rdzv, "--rdzv-id", run_id, "--local-addr", "127.0.0.1"], None
    rdzv = ["--nnodes", str(nnodes), "--rdzv-backend", STATIC_BACKEND, "--rdzv-endpoint", f"{addr}:{port}"]
    return [*rdzv, "--rdzv-id", run_id, "--rdzv-conf", f"rank={node_rank}"], bind_env(env, single_host=False)

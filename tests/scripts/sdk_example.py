# The original design's SDK example (section 2.2), on 2 CPU ranks with Gloo (tests/test_launch.py).
import sys

import torch

import kuangchao.distributed as kc

kc.init(trusted="--trusted" in sys.argv)
rank = torch.distributed.get_rank()
world = torch.distributed.get_world_size()
comm_group = kc.CommGroup(ranks=list(range(world)), backend="gloo", timeout_ms=30000)
gradient_tensor = torch.full((4,), float(rank + 1))
kc.all_reduce(tensor=gradient_tensor, group=comm_group, op="sum")
print(f"rank {rank}: {gradient_tensor.tolist()}", flush=True)

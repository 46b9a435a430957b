"""``hal.lazy_dynamo``: a rank that never compiles does not import ``torch._dynamo`` (about 1.5 s of CPU per process)
and trains bitwise as with torch's own wrappers.

The probe runs in a fresh interpreter (this one may have imported dynamo for another test). It builds an AdamW (the
engine's optimizer), steps it with a scheduler, zeroes, saves and loads its state, runs ops under the stand-in
device's dispatch mode, and records whether dynamo was imported and the parameters' bytes. Negative control: torch's
own wrapper, called once, imports dynamo (so the check would see a lost saving). Then the same training again, now
through torch's wrappers (what a process that compiles runs), is the reference the first must match bit for bit
(same ops in the same order: no tolerance)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys
import torch
from kuangchao_core.hal import lazy_dynamo, stand_in


def train():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    grad_mode = []
    for _ in range(4):
        model(torch.randn(5, 8, dtype=torch.float64)).square().mean().backward()
        opt.step()
        grad_mode.append(torch.is_grad_enabled())
        sched.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    with stand_in._Dispatch():
        torch.ones(3).add(1)
    steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
    return {"params": [p.detach().numpy().tobytes().hex() for p in model.parameters()], "steps": steps,
            "grad_mode_after_step": grad_mode}


lazy = {**train(), "dynamo": "torch._dynamo" in sys.modules, "installed": lazy_dynamo.install()}
# the negative control: torch's own wrapper imports dynamo
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
torch.optim.Optimizer.zero_grad.__kc_torch_wrapper__(opt)
wrapped = {**train(), "dynamo": "torch._dynamo" in sys.modules}  # now every call goes through torch's wrappers
print(json.dumps({"lazy": lazy, "wrapped": wrapped}))
"""


def _probe() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_that_never_compiles_does_not_import_dynamo_and_trains_bitwise_as_torchs_wrappers():
    found = _probe()
    lazy, wrapped = found["lazy"], found["wrapped"]
    assert lazy["installed"] == [
        "Optimizer.add_param_group",
        "Optimizer.zero_grad",
        "Optimizer.state_dict",
        "Optimizer.load_state_dict",
        "Adam.step",
    ], "each entry point this was written against is still torch's wrapper"
    assert lazy["dynamo"] is False
    assert wrapped["dynamo"] is True, "negative control: torch's wrapper imports dynamo, and the check sees it"
    assert lazy["grad_mode_after_step"] == wrapped["grad_mode_after_step"] == [True] * 4
    assert lazy["params"] == wrapped["params"]
    assert lazy["steps"] == wrapped["steps"] == [4.0] * len(lazy["steps"])

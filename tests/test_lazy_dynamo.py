"""``hal.lazy_dynamo``: a rank that never compiles does not import ``torch._dynamo`` (about 2 s of CPU per process)
and trains bitwise as with torch's own wrappers.

The probe runs in a fresh interpreter (this one may have imported dynamo for another test). It builds an AdamW (the
engine's optimizer), steps it with a scheduler, zeroes, saves and loads its state, runs ops under the stand-in
device's dispatch mode, and records whether dynamo was imported and the parameters' bytes. Negative control: torch's
wrappers put back (the behaviour before the change) import dynamo, so the check would see a lost saving; that
training is the reference the first must match bit for bit (same ops in the same order: no tolerance). A third
training, through ours again but with dynamo now imported (what a process that compiles runs: each call goes on to
torch's wrapper), must match it too."""

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


def entry_points():
    return [(torch.optim.Optimizer, n) for n in lazy_dynamo.OPTIMIZER_METHODS] + [
        (torch.optim.Adam, "step"), (stand_in._Dispatch, "__torch_dispatch__")]


lazy = {**train(), "dynamo": "torch._dynamo" in sys.modules, "installed": lazy_dynamo.install()}
ours = {(cls, name): cls.__dict__[name] for cls, name in entry_points()}
for (cls, name), fn in ours.items():  # the negative control: torch's wrappers back, as before the change
    setattr(cls, name, getattr(fn, "__kc_torch_wrapper__", fn))
reverted = {**train(), "dynamo": "torch._dynamo" in sys.modules}
for (cls, name), fn in ours.items():  # ours again, now with dynamo imported: what a process that compiles runs
    setattr(cls, name, fn)
delegated = train()
print(json.dumps({"lazy": lazy, "reverted": reverted, "delegated": delegated}))
"""


def _probe() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_that_never_compiles_does_not_import_dynamo_and_trains_bitwise_as_torchs_wrappers():
    found = _probe()
    lazy, reverted, delegated = found["lazy"], found["reverted"], found["delegated"]
    assert lazy["installed"] == [
        "Optimizer.add_param_group",
        "Optimizer.zero_grad",
        "Optimizer.state_dict",
        "Optimizer.load_state_dict",
        "Adam.step",
    ], "each entry point this was written against is still torch's wrapper"
    assert lazy["dynamo"] is False
    assert reverted["dynamo"] is True, "negative control: with torch's wrappers back, the check sees dynamo imported"
    for other in (reverted, delegated):
        assert other["params"] == lazy["params"]
        assert other["steps"] == lazy["steps"] == [4.0] * len(lazy["steps"])
        assert other["grad_mode_after_step"] == lazy["grad_mode_after_step"] == [True] * 4

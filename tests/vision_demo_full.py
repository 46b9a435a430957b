"""The full vision demo check (issue 31): ``python -m tests.vision_demo_full [WORKDIR] [key=value ...]``.

Generates the shape set (``kc data shapes``: 2048 training images, 64 held-out, 32 px) under WORKDIR, trains
``configs/vision-demo.yaml`` on two CPU ranks (decoder tp2, the encoder data-parallel over the TP ranks) and prints
the held-out exact match, the wall time and the data wait's share of the step time; exits 1 below 90 % exact match or
at a data-wait share of 5 % or more. Takes minutes: not part of ``make test`` (tests/test_vision_demo.py runs a short
version).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.mp import run_distributed
from tests.vision_demo import demo_config, run_demo


def main(argv: list[str]) -> int:
    from kuangchao_core.data.shapes import make_shape_set

    work = Path(argv[0] if argv and "=" not in argv[0] else "vision-demo-check").resolve()
    overrides = dict(a.split("=", 1) for a in argv if "=" in a)
    shapes = work / "shapes"
    if not (shapes / "train.jsonl").exists():
        make_shape_set(shapes, num_train=2048, num_heldout=64, seed=0, size=32)
    cfg = demo_config(work, shapes, **overrides)
    t0 = time.time()
    result = run_distributed(run_demo, 2, args=(cfg,), timeout=3600)[0]
    seconds = time.time() - t0
    match, share = result["after"][1], result["wait"]["share"]
    print(f"vision demo: held-out exact match {match:.3f}, held-out loss {result['after'][0]:.4f}, ")
    print(f"  {len(result['losses'])} steps in {seconds:.0f} s (wall, 2 ranks), data wait {share:.2%} of step time")
    return 0 if match >= 0.9 and share < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Tokenize once: start-up time and memory of a rank's dataset, today's in-memory tokenization vs the cache.

A JSON-lines corpus of ``--docs`` arithmetic lines (the demo's corpus has 20 000; the default is 100x that) is
written once. Each measurement runs in a fresh process (so nothing is shared between them) and reports the wall time
of ``build_dataset`` and the growth of the process's resident memory (RSS) it caused:

- ``plain``: today's path, every rank reads and tokenizes the files into memory;
- ``cache-build``: the first start with ``data.cache_dir`` (tokenizes once and writes the arrays);
- ``cache-read``: a later start (maps the arrays; nothing of the corpus is read until a window is).

Then ``--docs / 100`` repeats the cached read, to show memory per rank does not grow with the corpus.

    .venv/bin/python benchmarks/data_cache.py [--docs 2000000]

Goals (issue 14): the second start ≥ 10x faster than today's; memory per rank independent of corpus size. Ends with
``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_KEYS = ("docs", "plain", "cache-build", "cache-read", "cache-read-1/100", "speedup_second_start")


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


def measure(corpus: str, cache: str | None) -> dict:
    """One start in this process: seconds and RSS growth of building the dataset, and one window read."""
    from kuangchao_core.data import build_dataset
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    data = {"path": corpus, "format": "jsonl", "seq_len": 128, **({"cache_dir": cache} if cache else {})}
    rss0, t0 = _rss(), time.perf_counter()
    ds = build_dataset(data, 256)
    seconds = time.perf_counter() - t0
    ds[len(ds) // 2]
    return {"seconds": seconds, "rss_growth": _rss() - rss0, "tokens": ds.num_tokens}


def _fresh(corpus: str, cache: str | None) -> dict:
    code = f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.data_cache import measure; "
    code += f"print('M ' + json.dumps(measure({corpus!r}, {cache!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(next(line[2:] for line in out.splitlines() if line.startswith("M ")))


def _write(path: Path, docs: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(docs):
            a, b = (i * 7919) % 100, (i * 104729) % 100
            f.write(json.dumps({"text": f"{a}+{b}={a + b}"}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=2_000_000)
    ap.add_argument("--smoke", action="store_true", help="2,000 documents (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.docs = 2_000
    from _results import emit  # here: a measuring child imports this module as benchmarks.data_cache

    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big", Path(tmp) / "small"
        big.mkdir()
        small.mkdir()
        _write(big / "corpus.jsonl", args.docs)
        _write(small / "corpus.jsonl", max(1, args.docs // 100))
        cache = str(Path(tmp) / "cache")
        res = {
            "plain": _fresh(str(big), None),
            "cache-build": _fresh(str(big), cache),
            "cache-read": _fresh(str(big), cache),
        }
        _fresh(str(small), cache)
        res["cache-read-1/100"] = _fresh(str(small), cache)
    for name, r in res.items():
        print(f"{name:<17} {r['seconds']:8.3f} s  RSS +{r['rss_growth'] / 2**20:8.1f} MiB  ({r['tokens']:,} tokens)")
    speedup = res["plain"]["seconds"] / res["cache-read"]["seconds"]
    print(f"second start {speedup:.0f}x faster than today's (goal >= 10x)")
    emit({"docs": args.docs, **res, "speedup_second_start": round(speedup, 1)}, RESULT_KEYS, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

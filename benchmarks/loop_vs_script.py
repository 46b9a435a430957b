"""Kuangchao's training loop against a 300-line training script (issue 39's "Done when"): ``kc train`` of the
real-text demo's model and batch against ``benchmarks/_gpt_script.py`` (plain PyTorch, GPT-2 style, the same
parameters, batch and sequence), on the same prepared corpus, single process and data parallel over two Gloo
processes (``torchrun``), alternating.

Both sides train on the tokens of one ``kc data prepare`` of ``--corpus`` (default: a generated corpus; the
figures in RESULTS.md are of the Shakespeare plays of ``examples/shakespeare.sh``): ``kc train`` reads its cache,
the script the same ids written out as ``train.bin``/``val.bin``. The model: 4 layers, 128 wide, 4 heads, vocabulary
the tokenizer's; Kuangchao's Llama with SwiGLU width 344 (the GPT-2 MLP's 4·d parameters), 12 sequences of 64
tokens a step (6 per rank at dp2), the held-out loss over the whole held-out split every ``--eval-interval`` steps
(the demo's cadence: every 250 steps) and 4 greedy samples of 48 tokens after the last step, a checkpoint at the
end. Measured per run: the loop's tokens/s, evaluations included (``kc train``: ``tokens_per_s_loop`` of its
``summary.json``; the script: its own clock from the start of step 1 to the end of the last); the start-up, from
the process's start to the end of step 1 (``kc train``: ``startup_s.total``; the script: from its launch) and
the seconds after the last step to the end (``after_last_step_s.total``; the script: to its exit). Each block runs
both sides of one layout back to back, the order flipped every block; one ratio per block, ours ÷ script
(``benchmarks/_ratios.py``): for throughput above 1 is faster, for seconds below 1 is faster.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/loop_vs_script.py --corpus out/shakespeare/plays [--blocks 2]

``--baseline DIR`` (a checkout of the code before a change, e.g. ``git worktree add DIR <commit>``) adds a third
side, ``kc train`` of that code (``PYTHONPATH=DIR``), to every block, the three sides' order rotated block by block:
the before and after of a change measured in one session, each against the same script runs
(``loop_tokens_per_s_<layout>_base`` is the baseline ÷ the script, ``..._vs_base`` ours ÷ the baseline).

The last line is ``RESULT {json}``: ``ratio_vs_peer``, ``ratio_iqr``, ``ratio_min_max``, ``blocks`` keyed by
``loop_tokens_per_s_<layout>``, ``startup_<layout>`` and ``after_last_step_<layout>``; ``medians`` (each side's),
``eval_loss`` (each side's last held-out loss, nats/token), ``setup``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, keyed_result_fields  # noqa: E402
from _results import emit  # noqa: E402

RESULT_KEYS = (*FIELDS, "medians", "eval_loss", "setup")

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
KC = [PY, "-m", "kuangchao.cli.main"]
SEQ, BATCH = 64, 12
#: the demo's model (examples/shakespeare.sh): 4 layers, 128 wide, 4 heads, full multi-head attention
MODEL = {"hidden_size": 128, "intermediate_size": 344, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4}


def _generated_corpus(folder: Path, files: int, lines: int) -> Path:
    rng = random.Random(0)
    words = "the king queen lord speak thou art thy heart love death night day sword crown good my o".split()
    folder.mkdir(parents=True)
    for k in range(files):
        text = [" ".join(rng.choices(words, k=rng.randint(3, 12))) + ("\n" if i % 4 == 3 else "") for i in range(lines)]
        (folder / f"text_{k}.txt").write_text("\n".join(text) + "\n", encoding="utf-8")
    return folder


def _prepare(corpus: Path, work: Path, vocab: int, env: dict[str, str]) -> tuple[Path, int]:
    """``kc data prepare`` of ``corpus``, and its token ids written as the script's ``train.bin``/``val.bin``."""
    out = work / "prepared"
    argv = [*KC, "data", "prepare", str(corpus), "--out", str(out), "--vocab-size", str(vocab)]
    subprocess.run([*argv, "--seq-len", str(SEQ), "--name", "loopbench"], env=env, check=True, cwd=work)
    import yaml

    from kuangchao_core import guard_api
    from kuangchao_core.data.dataset import build_dataset

    data = yaml.safe_load((out / "config.yaml").read_text())["data"]
    vocab_size = yaml.safe_load((out / "config.yaml").read_text())["model"]["vocab_size"]
    with guard_api.thread_guard(guard_api.AllowAll()):
        for name, key in (("train.bin", "path"), ("val.bin", "eval_path")):
            tokens = build_dataset({**data, "path": data[key]}, vocab_size, split="train").tokens
            tokens.numpy().astype("<u2").tofile(out / name)
    return out, int(vocab_size)


def _kc_run(prepared: Path, work: Path, env: dict, dp: int, steps: int, every: int) -> dict[str, float]:
    sets = {f"model.{k}": v for k, v in MODEL.items()} | {
        "parallel.data_parallel_size": dp,
        "parallel.micro_batch_size": BATCH // dp,
        "train.steps": steps,
        "train.warmup_steps": max(1, steps // 20),
        "optimizer.lr": 3e-3,
        "train.eval_interval": every,
        "train.log_interval": every,
        "checkpoint.interval": steps,
        "train.samples.count": 4,
        "train.samples.max_new_tokens": 48,
        "train.samples.every": steps,
        "train.samples.at_end": "true",
        "checkpoint.dir": work / "ckpt",
        "tracking.uri": f"sqlite:///{work / 'mlflow.db'}",
        "permission.audit_log": work / "audit",
    }
    argv = [*KC, "train", "--config", str(prepared / "config.yaml"), "--resume", "never"]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    before = set((work / "runs").glob("*/*/summary.json"))
    with open(work / "console.log", "a") as log:
        subprocess.run(argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, check=True)
    (summary_path,) = set((work / "runs").glob("*/*/summary.json")) - before
    s = json.loads(summary_path.read_text())
    return {
        "tokens_per_s": s["tokens_per_s_loop"],
        "startup": s["startup_s"]["total"],
        "after_last_step": s["after_last_step_s"]["total"],
        "eval_loss": (s.get("heldout") or {}).get("eval_loss"),
    }


def _script_run(prepared: Path, work: Path, env: dict, dp: int, steps: int, every: int, vocab: int) -> dict:
    out = work / "script.json"
    script = [str(ROOT / "benchmarks" / "_gpt_script.py"), "--data", str(prepared), "--vocab", str(vocab)]
    script += ["--steps", str(steps), "--eval-interval", str(every), "--warmup", str(max(1, steps // 20))]
    script += ["--batch", str(BATCH), "--seq", str(SEQ), "--out", str(out)]
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(dp)] if dp > 1 else [PY]
    launched = time.time()
    with open(work / "console.log", "a") as log:
        subprocess.run([*launcher, *script], env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, check=True)
    ended = time.time()
    r = json.loads(out.read_text())
    return {
        "tokens_per_s": r["tokens_per_s_loop"],
        "startup": r["step_1_end"] - launched,
        "after_last_step": ended - r["last_step_end"],
        "eval_loss": r["eval_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=None, help="a folder of .txt files (default: a generated corpus)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eval-interval", type=int, default=250)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--layouts", default="single,dp2")
    parser.add_argument("--prefect-api", default=None, help="a running Prefect API (default: the temporary server)")
    parser.add_argument("--baseline", default=None, help="a checkout of the code before a change: a third side")
    parser.add_argument("--smoke", action="store_true", help="one block at dp2, 4 steps, a small generated corpus")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.steps, args.eval_interval, args.vocab_size, args.layouts = 1, 4, 2, 300, "dp2"

    load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="kc-loopbench-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "KC_RUNS_DIR": str(work / "runs")}
    env.pop("PREFECT_API_URL", None)
    if args.prefect_api:
        env["PREFECT_API_URL"] = args.prefect_api
    corpus = Path(args.corpus) if args.corpus else _generated_corpus(work / "corpus", 2, 400 if args.smoke else 20000)
    prepared, vocab = _prepare(corpus.resolve(), work, args.vocab_size, env)
    print(f"work directory {work}; corpus {corpus}; vocabulary {vocab}", flush=True)
    layouts = {"single": 1, "dp2": 2}
    runs: dict[str, dict[str, list[dict]]] = {}
    sides = ("ours", "script", "base") if args.baseline else ("ours", "script")
    base_env = {**env, "PYTHONPATH": str(Path(args.baseline).resolve())} if args.baseline else env
    for name in args.layouts.split(","):
        dp, runs[name] = layouts[name], {side: [] for side in sides}
        for b in range(args.blocks):
            k = b % len(sides)
            order = sides[k:] + sides[:k] if args.baseline else (sides if b % 2 == 0 else sides[::-1])
            for side in order:
                if side != "script":
                    r = _kc_run(prepared, work, env if side == "ours" else base_env, dp, args.steps, args.eval_interval)
                else:
                    r = _script_run(prepared, work, env, dp, args.steps, args.eval_interval, vocab)
                runs[name][side].append(r)
                print(
                    f"{name} block {b} {side}: {r['tokens_per_s']:,.0f} tokens/s over the loop, start-up "
                    f"{r['startup']:.1f} s, after the last step {r['after_last_step']:.1f} s, "
                    f"held-out {r['eval_loss']:.4f}",
                    flush=True,
                )
    stats, medians, losses = {}, {}, {}
    for name, sides in runs.items():
        for what, label in (("tokens_per_s", "loop_tokens_per_s"), ("startup", "startup"), ("after_last_step",) * 2):
            for suffix, a, b in (("", "ours", "script"), ("_base", "base", "script"), ("_vs_base", "ours", "base")):
                if a in sides and b in sides:
                    pairs = zip(sides[a], sides[b], strict=True)
                    stats[f"{label}_{name}{suffix}"] = block_stats([([o[what]], [s[what]]) for o, s in pairs])
            for side in sides:
                medians.setdefault(side, {})[f"{label}_{name}"] = round(
                    statistics.median(r[what] for r in sides[side]), 2
                )
        losses[name] = {side: round(statistics.median(r["eval_loss"] for r in sides[side]), 4) for side in sides}
    for key, s in stats.items():
        print(format_line(f"kc train ÷ script, {key}", s))
    print(f"medians: {json.dumps(medians)}\nheld-out loss (nats/token): {json.dumps(losses)}")
    setup = {
        "corpus": str(corpus) if args.corpus else "generated",
        "steps": args.steps,
        "eval_interval": args.eval_interval,
        "batch": BATCH,
        "seq_len": SEQ,
        "vocab": vocab,
        "model": MODEL,
        "load_avg_1m_start": round(load_start, 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "baseline": args.baseline,
    }
    result = {**keyed_result_fields(stats), "medians": medians, "eval_loss": losses, "setup": setup}
    emit(result, RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()

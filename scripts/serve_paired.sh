#!/bin/bash
# Two fresh servers side by side, `ar` on port 8021 and `auto` on 8022, passes alternating
# (docs/results/serve-1.5b-http-paired/paired.md; summarize with scripts/serve_paired_summary.py).
#
#   OUT=docs/results/serve-1.5b-http-paired/NAME scripts/serve_paired.sh
#   OUT=... ROUNDS="1 2" PAIRS16=5 PAIRS=2 CONCURRENCIES="16 4 1" scripts/serve_paired.sh
#
# Each round starts both servers (the default pair: the 1.5B on the lean backend, its 0.5B drafter and Max-Gram),
# warms each with 8 requests at C = 4, then at each concurrency runs pairs of `speculant bench-serve` passes
# (the 24 mixed prompts, 64 new tokens, greedy, streamed), the order within a pair alternating, and stops both.
# One idle server takes no CPU, so the other serves as if alone. Why: a fresh server per pass spreads too widely
# between processes to decide a few percent; pairs of passes a minute apart do.
# Run it from a checkout (or `git worktree`) of the commit measured; it sets PYTHONPATH to the current directory.
set -eu
case "${1:-}" in -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
: "${OUT:?set OUT to the result directory}"
export PYTHONPATH=$PWD
pass() {  # method port C label
  python -m speculant.cli bench-serve --url http://localhost:$2/v1 --prompts prompts/mixed.jsonl --max-tokens 64 \
    --requests ${REQUESTS:-24} --concurrency $3 --label $4 --out $OUT > /dev/null 2>&1
}
for round in ${ROUNDS:-1 2 3}; do
  python -m speculant.cli serve --target qwen2.5-coder-1.5b --port 8021 --method ar > /tmp/server-ar.log 2>&1 &
  par=$!
  for i in $(seq 1 300); do curl -sf localhost:8021/v1/models > /dev/null && break; sleep 1; done
  python -m speculant.cli serve --target qwen2.5-coder-1.5b --port 8022 --method auto > /tmp/server-auto.log 2>&1 &
  pauto=$!
  for i in $(seq 1 300); do curl -sf localhost:8022/v1/models > /dev/null && break; sleep 1; done
  REQUESTS=8 pass ar 8021 4 warm-r$round; REQUESTS=8 pass auto 8022 4 warm-r$round
  for C in ${CONCURRENCIES:-16 4 1}; do
    n=${PAIRS:-2}; [ $C = 16 ] && n=${PAIRS16:-4}
    for p in $(seq 1 $n); do
      if [ $(( (p + round) % 2 )) = 0 ]; then order="ar:8021 auto:8022"; else order="auto:8022 ar:8021"; fi
      for mp in $order; do pass ${mp%%:*} ${mp##*:} $C r$round-p$p; done
    done
  done
  kill $par $pauto; wait $par $pauto 2>/dev/null || true
done

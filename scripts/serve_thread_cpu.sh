#!/bin/bash
# CPU seconds per thread of an `ar` and an `auto` server over one bench-serve pass at C = 16
# (docs/results/serve-1.5b-repeats/in-process.md, "Where the CPU goes in the two servers").
#
#   scripts/serve_thread_cpu.sh            # both methods, one fresh server each, port 8021
#   METHODS=auto C=4 scripts/serve_thread_cpu.sh
#
# Reads each thread's user + system ticks from /proc/PID/task/*/stat before and after the pass (1/100 s) and
# prints the threads that used more than 0.05 s. Why: to see whether anything besides the batcher thread and the
# OpenMP worker takes a core from the forwards (the event loop, auto's choices), which a wall time cannot show.
set -eu
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
snap() { for t in /proc/$1/task/*; do echo "$(basename $t) $(awk '{print $14+$15}' $t/stat)"; done | sort; }
for m in ${METHODS:-ar auto}; do
  speculant serve --target qwen2.5-coder-1.5b --port 8021 --method $m & pid=$!
  until curl -sf localhost:8021/v1/models > /dev/null; do sleep 1; done
  snap $pid > /tmp/threads-before
  speculant bench-serve --url http://localhost:8021/v1 --prompts prompts/mixed.jsonl --max-tokens 64 \
    --requests 24 --concurrency ${C:-16} --label $m
  snap $pid > /tmp/threads-after
  echo "$m: thread, CPU seconds"
  join /tmp/threads-before /tmp/threads-after | awk '{d = ($3 - $2) / 100; if (d > 0.05) print $1, d}'
  kill $pid; wait $pid || true
done

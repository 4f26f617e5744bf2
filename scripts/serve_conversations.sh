#!/bin/bash
# Multi-turn conversations arriving open loop, against `auto` with the prefix cache, `ar` without it and llama.cpp's
# own `llama-server` with its prompt cache, each server alone, at two arrival rates
# (docs/results/serve-conversations/report.md; the README's serving section).
#
#   OUT=docs/results/serve-conversations scripts/serve_conversations.sh
#   OUT=... RATES="0.05 0.2" CONVERSATIONS=8 TURNS=3 TOKENS=48 SERVERS="auto-cache" scripts/serve_conversations.sh
#
# The 1.5B on the lean backend (the default serving pair: its 0.5B drafter and Max-Gram for `auto`); the four long
# RAG and summarization prompts (1.7-3.2k tokens) and the first four mixed chat prompts open the conversations, each
# with TURNS turns (the later turns resend the history with a follow-up question), greedy, streamed. Every server
# starts fresh for each rate, so no prompt is cached from an earlier run; while a speculant server runs, its
# /metrics is read every 2 s and the largest prefix-cache size is recorded (`prefix-cache-peak.txt`).
# Run it from a checkout (or `git worktree`) of the commit measured; it sets PYTHONPATH to the current directory.
set -eu
case "${1:-}" in -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
: "${OUT:?set OUT to the result directory}"
export PYTHONPATH=$PWD
mkdir -p "$OUT"
PROMPTS=prompts/long.jsonl+prompts/mixed.jsonl[:4]
GGUF=$(python -c "from speculant.models.catalog import CATALOG, gguf_checkpoint; print(gguf_checkpoint(CATALOG['qwen2.5-coder-1.5b']) / 'model.gguf')")
BIN=$(python -c "from speculant.models.backends.llamacpp_build import tool; print(tool('llama-server').parent)")
wait_up() { for i in $(seq 1 300); do curl -sf localhost:$1/v1/models > /dev/null && return; sleep 1; done; exit 1; }
peak() {  # the largest speculant_prefix_cache_bytes seen while the pass runs
  local most=0
  while kill -0 $1 2> /dev/null; do
    b=$(curl -sf localhost:8031/metrics | awk '/^speculant_prefix_cache_bytes /{printf "%d", $2}')
    [ -n "$b" ] && [ "$b" -gt "$most" ] && most=$b
    sleep 2
  done
  echo $most
}
pass() {  # port label rate
  python -m speculant.cli bench-serve --url http://localhost:$1/v1 --prompts "$PROMPTS" --requests ${CONVERSATIONS:-8} \
    --turns ${TURNS:-3} --rate $3 --max-tokens ${TOKENS:-48} --label $2 --out "$OUT" &
  local p=$!
  if [ $1 = 8031 ]; then echo "$2 rate $3: $(peak $p) bytes at most" >> "$OUT/prefix-cache-peak.txt"; fi
  wait $p
}
for rate in ${RATES:-0.05 0.2}; do
  for server in ${SERVERS:-auto-cache ar-no-cache llama-server}; do
    case $server in
      auto-cache) python -m speculant.cli serve --target qwen2.5-coder-1.5b --port 8031 --method auto > /tmp/conv-$server.log 2>&1 & port=8031;;
      ar-no-cache) python -m speculant.cli serve --target qwen2.5-coder-1.5b --port 8032 --method ar --prefix-cache-mb 0 > /tmp/conv-$server.log 2>&1 & port=8032;;
      llama-server) LD_LIBRARY_PATH=$BIN "$BIN/llama-server" -m "$GGUF" --port 8033 -t 2 -tb 2 -c 32768 -np 8 -fa on \
          -ctk bf16 -ctv bf16 --jinja > /tmp/conv-$server.log 2>&1 & port=8033;;
    esac
    pid=$!
    wait_up $port
    pass $port $server $rate
    kill $pid; wait $pid 2> /dev/null || true
  done
done

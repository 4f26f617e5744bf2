#!/usr/bin/env bash
# The CPU headline bench (auto and ar against llama.cpp's own llama-completion, mixed prompts and HumanEval[:10])
# for two commits of speculant on the same machine, in one sitting, alternated A B B A so that the machine's drift
# falls on both: mixed prompts for A then B, HumanEval for B then A. Each commit runs from a worktree of its own
# (PYTHONPATH), against the same installed dependencies and the same native llama.cpp build.
#
#   scripts/bench_commits.sh BEFORE AFTER OUT_DIR [MIXED_REPEATS] [HUMANEVAL_REPEATS]
#
# Writes OUT_DIR/{BEFORE,AFTER}-{mixed,humaneval}/ (report.md, results.json) and prints each report's headline rows.
set -euo pipefail
before=$1 after=$2 out=$3 mixed_repeats=${4:-2} humaneval_repeats=${5:-3}
root=$(git rev-parse --show-toplevel)
mkdir -p "$out"
for commit in "$before" "$after"; do
  [ -d "/tmp/bench-$commit" ] || git -C "$root" worktree add --detach "/tmp/bench-$commit" "$commit" >/dev/null
done

bench() {  # commit, prompt set
  local commit=$1 set=$2 args
  if [ "$set" = mixed ]; then
    args=(--prompts "$root/prompts/mixed.jsonl" --max-new-tokens 96 --repeats "$mixed_repeats")
  else
    args=(--dataset "humaneval[:10]" --max-new-tokens 128 --repeats "$humaneval_repeats")
  fi
  (cd "/tmp/bench-$commit" && PYTHONPATH="/tmp/bench-$commit" python -c \
    "import sys; from speculant.cli import main; sys.argv[0] = 'speculant'; main()" bench \
    --target qwen2.5-coder-1.5b "${args[@]}" --methods llamacpp-cli-ar ar auto --baseline llamacpp-cli-ar \
    --out "$out/$commit-$set")
  grep -E "^\| (llamacpp-cli-ar|ar|auto) " "$out/$commit-$set/report.md" | head -3
}

bench "$before" mixed
bench "$after" mixed
bench "$after" humaneval
bench "$before" humaneval

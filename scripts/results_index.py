"""Print docs/results/index.md: one row per entry of docs/results (what it is, its command, the commit that produced
it, the machine, the date), so the index is generated from the entries and git, not kept by hand.

    python scripts/results_index.py > docs/results/index.md
    python scripts/results_index.py --check          # exit 1 if docs/results/index.md is not what this writes

The command and machine of a bench or bench-serve directory are its report.md's `Command:` and `Machine:` lines
where it has them; the commit and date are those of the last commit that changed the entry's data (its report.md,
results or page; commits that only edited links are named in ENTRIES instead). What each entry is, and the
command and machine of pages, are written below. Pure Python (subprocess runs git).

`--check` reads the commits only where this repository holds the history the index was written from: in a shallow
clone, a copy without git, or history rewritten since (every commit the index names must exist), it checks the rest
of each row and says that it left the commits out.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
ZEN4 = "AMD EPYC Zen4 (AVX-512 VNNI and BF16, no AMX), 2 cores"
ZEN5 = "AMD EPYC, CPU family 26 (AVX-512 VNNI, BF16 and VP2INTERSECT, no AMX), 2 cores"
XEON = "Intel Xeon, Sapphire Rapids class (AVX-512, AMX), 2 cores"
ZEN3 = "AMD EPYC, CPU family 25 model 1 (Zen3: AVX2, no AVX-512), 2 cores"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def bench_commits(prefix: str, title: str, before: str, after: str, change: str, repeats: tuple[int, int],
                  machine: str) -> dict[str, tuple[str, str, None, str, None]]:
    """The four results of one `scripts/bench_commits.sh BEFORE AFTER` sitting (mixed prompts and HumanEval[:10], each
    commit; `repeats`: of each set)."""
    return {
        f"{prefix}-mixed": ("CPU", f"{title} at {after} ({change}), 24 mixed prompts, {plural(repeats[0], 'repeat')}, "
                                   f"run by `scripts/bench_commits.sh {before} {after}` beside {prefix}-before-*", None,
                            machine, None),
        f"{prefix}-humaneval": ("CPU", f"the same on HumanEval[:10], {plural(repeats[1], 'repeat')}, the same sitting",
                                None, machine, None),
        f"{prefix}-before-mixed": ("CPU", f"the same bench at {before}, before that change, in the same sitting "
                                          "(A B B A)", None, machine, None),
        f"{prefix}-before-humaneval": ("CPU", f"the same on HumanEval[:10] at {before}", None, machine, None),
    }


# name -> (group, what it is, command or None (the report's), machine or None (the report's), commit or None (git's))
ENTRIES: dict[str, tuple[str, str, str | None, str | None, str | None]] = {
    **bench_commits("bench-core", "**The CPU headline**: `ar` and `auto` on the lean backend against llama.cpp's "
                    "`llama-completion` (`llamacpp-cli-ar`)", "45636d9", "488dcd9",
                    "a drafter weighed only at lengths it could be accepted at", (2, 3), ZEN5),
    **bench_commits("bench-avx2", "The kernel change's bench on an AVX2-only EPYC (Zen3)", "da7519b", "3a1772c",
                    "the AVX2 kernels' sums kept in registers, tiles of 8 rows", (1, 1), ZEN3),
    **bench_commits("bench-avx2-catchup", "The catch-up change's bench on the Zen3 EPYC", "fd7c031", "a9b317e",
                    "a drafter's catch-up computes only the logits it returns", (1, 1), ZEN3),
    **bench_commits("bench-avx2-ceiling", "The plain-step ceiling's bench on the Zen3 EPYC", "73dfba0", "e47a4ef",
                    "a plain step read no dearer than the width verified last", (1, 1), ZEN3),
    **bench_commits("bench-avx2-rest", "The CPU headline on the AVX2-only EPYC (Zen3)", "e9be6dd", "b28a79d",
                    "a model candidate that lost to plain decoding rests before it is weighed again", (1, 1), ZEN3),
    **bench_commits("bench-avx2-head", "The CPU headline on the AVX2-only EPYC (Zen3) until 12-02", "b28a79d",
                    "6a648d5",
                    "Max-Gram's lookups from the last context's array, a cache's catch-up or prefill by its profile, "
                    "a spent probe budget read first", (1, 1), ZEN3),
    "bench-avx2-1204-mixed": ("CPU", "**The CPU headline on the AVX2-only EPYC (Zen3)** at c0e1ff3, 24 mixed prompts, "
                              "2 repeats, `llamacpp-cli-ar` in the same run", None, ZEN3, None),
    "bench-avx2-1204-humaneval": ("CPU", "the same on HumanEval[:10], 3 repeats, right after", None, ZEN3, None),
    **bench_commits("bench-xeon-amx", "The AMX cut-over's bench on the Xeon", "0edc90b", "70ed6f3",
                    "the AMX tiles' cut-over per kind, a super-block unpacked before its first tile load", (1, 1),
                    XEON),
    "bench-xeon-review-mixed": ("CPU", "**The CPU headline on the Xeon with AMX** at 246cc1c (a session of "
                                "correctness fixes), 24 mixed prompts, one repeat, run by `scripts/bench_commits.sh "
                                "bd9408d 246cc1c` beside bench-xeon-review-before-mixed", None, XEON, None),
    "bench-xeon-review-before-mixed": ("CPU", "the same bench at bd9408d, before those fixes, in the same sitting",
                                       None, XEON, None),
    "bench-xeon-review-humaneval": ("CPU", "the same on HumanEval[:10] at 246cc1c, one repeat, in the same sitting",
                                    None, XEON, None),
    "bench-xeon-review-before-humaneval": ("CPU", "the same on HumanEval[:10] at bd9408d, after it in that sitting",
                                           None, XEON, None),
    **bench_commits("bench-avx2-catchrule", "Catch-ups priced as they cost, on the Zen3 EPYC", "49c934f", "4f1b570",
                    "a cache's catch-up or prefill by its profile, and auto pricing a catch-up as it costs", (1, 1),
                    ZEN3),
    "bench-avx2-catchrule-mixed-2": ("CPU", "bench-avx2-catchrule-mixed's bench again at 4f1b570 right after that "
                                     "sitting, then bench-avx2-catchrule-before-mixed-2's (B A)", None, ZEN3, None),
    "bench-avx2-catchrule-before-mixed-2": ("CPU", "the same second sitting at 49c934f", None, ZEN3, None),
    "catch-up-lags-avx2.json": ("CPU", "the 0.5B's catch-up on 100 to 2000 tokens after 6 kept, against a prefill of "
                                "the whole, beside what its machine profile predicts and the way it chooses",
                                "python scripts/catch_up_prefill.py --lags 100 400 1000 2000 --repeats 2 "
                                "--out docs/results/catch-up-lags-avx2.json", ZEN3, None),
    "catch-up-lags-keep300-avx2.json": ("CPU", "the same after 300 kept, on 40 to 1500 tokens",
                                        "python scripts/catch_up_prefill.py --keep 300 --lags 40 300 1500 --repeats 1 "
                                        "--out docs/results/catch-up-lags-keep300-avx2.json", ZEN3, None),
    "catch-up-avx2.json": ("CPU", "a cache's catch-up on a new prompt (the 0.5B and the 1.5B on lean) as a forward of "
                           "every row, as `catch_up` (the last row's logits only) and as a prefill",
                           "python scripts/catch_up_prefill.py --out docs/results/catch-up-avx2.json", ZEN3, None),
    "kernels-avx2.json": ("CPU", "T(W) of the 4-bit kernels' AVX2 path alone on the 1.5B's 197 matrices, on the CPU "
                          "where it is the path that runs, after the kernel change",
                          "speculant bench-kernels --widths 1,2,4,8,16 --isa avx2 --repeats 5 "
                          "--out docs/results/kernels-avx2.json", ZEN3, None),
    "lean-avx2-profiles.json": ("CPU", "the machine profiles (T(W) of the whole lean forward, TTFT) that the 1.5B and "
                                "its 0.5B drafter measured for the AVX2 kernels before and after their change, and for "
                                "the kernel bench-avx2-head-* ran as profile versions 2 and 3 measured it, and as "
                                "the 12-02 headline (087ebf4) ran, copied from the profile cache",
                                "measured by the bench-avx2-* runs (`speculant profile` shows one)",
                                ZEN3, None),
    "bench-humaneval-10-30": ("CPU", "`auto` on twenty HumanEval problems never used while tuning (HumanEval[10:30])",
                              None, ZEN4, None),
    "bench-lean-mixed": ("CPU", "llama.cpp's own speculative tools (`llamacpp-cli-spec`, `llamacpp-cli-ngram`) against "
                         "`llamacpp-cli-ar`, each generation in a fresh process; its `ar`/`auto`/`sd` rows are "
                         "older than bench-core-*", None, ZEN4, None),
    "bench-lean-humaneval": ("CPU", "the same on HumanEval[:10]", None, ZEN4, None),
    "kernels-1.5b.json": ("CPU", "T(W) of speculant's 4-bit kernels alone on the 1.5B's 197 matrices, AVX-512 VNNI "
                          "and AVX2, after the per-256 activation scales",
                          "speculant bench-kernels --widths 1,2,4,8,16 --isa avx512_vnni avx2 "
                          "--out docs/results/kernels-1.5b.json", ZEN4, None),
    "cpu.md": ("CPU", "speculant and llama.cpp on the CPU: ggml's paths, the lean model's kernels and T(W), drafters "
               "on them, every bench's reasons", "commands and scripts in the page", f"{XEON}; {ZEN4}; {ZEN3}", None),
    "bench-suffix-mixed": ("CPU", "suffix decoding as a drafter (`sd`) and inside `auto`, in process", None, ZEN4,
                           None),
    "bench-suffix-humaneval": ("CPU", "the same on HumanEval[:10]", None, ZEN4, None),
    "bench-smollm2-lean-mixed": ("CPU", "SmolLM2-135M on the lean kernels drafting across tokenizers (`sd`, `auto`)",
                                 None, ZEN4, None),
    "bench-smollm2-lean-humaneval": ("CPU", "the same on HumanEval[:10]", None, ZEN4, None),
    "bench-self-skip-mixed": ("CPU", "self-speculation by layer skipping (`self@skip`) as `sd` and in `auto`", None,
                              ZEN4, None),
    "bench-self-skip-humaneval": ("CPU", "the same on HumanEval[:10]", None, ZEN4, None),
    "bench-depth-mixed": ("CPU", "Yggdrasil's depth predictors (hidden state, four features) against the "
                          "level-by-level objective, beside `llama-completion` (cpu.md)", None, ZEN5, None),
    "bench-depth-humaneval": ("CPU", "the same on HumanEval[:10]", None, ZEN5, None),
    "structured-output.md": ("CPU", "structured output under speculation: JSON schemas, drafts that follow the "
                             "grammar, "
                             "llguidance's mask cost", "commands in the page", ZEN4, "1b5eb52"),
    "bench-json-schema": ("CPU", "eight JSON-extraction prompts under their schemas, beside `llama-completion "
                          "--json-schema`", None, ZEN4, None),
    "bench-json-free": ("CPU", "the same prompts as free text (`--ignore-response-format`)", None, ZEN4, None),
    "bench-llamacpp-cli-isolated-mixed": ("llama.cpp backend", "speculant's llama.cpp backend (`ar`, `auto`) against "
                                          "`llama-completion` on the same library, each generation in a fresh process",
                                          None, ZEN4, None),
    "bench-llamacpp-cli-isolated-humaneval": ("llama.cpp backend", "the same on HumanEval[:10]", None, ZEN4, None),
    "bench-dsi-1-server-mixed": ("llama.cpp backend", "DSI with one target server in its own process against `sd` with "
                                 "the same drafter (Max-Gram, the 0.5B), after the drafter's restart fix", None, ZEN4,
                                 None),
    "bench-dsi-1-server-humaneval": ("llama.cpp backend", "the same on HumanEval[:8]", None, ZEN4, None),
    "dsi-preemption.md": ("llama.cpp backend", "DSI: preempted forwards cut short inside the model, before and after",
                          "commands and script in the page", XEON, "5dcedce"),
    "dsi-timeline-real-process.png": ("llama.cpp backend", "DSI timeline of a real two-server run (dsi-preemption.md)",
                                      "speculant generate ... --method dsi --timeline", XEON, None),
    "cross-vocab.md": ("llama.cpp backend", "drafters with another tokenizer (SmolLM2-135M for Qwen targets): speed, "
                       "the cost of sampling on shared tokens, token healing, incremental encoding",
                       "commands and script in the page", f"{XEON}; the encoding timing on {ZEN4}", "30013d6"),
    "bench-cross-vocab-1.5b-mixed": ("llama.cpp backend", "SmolLM2-135M (GGUF, bf16, int8, int4) against the 0.5B "
                                     "drafting "
                                     "for the 1.5B", None, XEON, None),
    "bench-cross-vocab-1.5b-humaneval": ("llama.cpp backend", "the same on HumanEval[:8]", None, XEON, None),
    "bench-cross-vocab-0.5b-mixed": ("llama.cpp backend", "SmolLM2-135M drafting for the 0.5B", None, XEON, None),
    "bench-cross-vocab-0.5b-humaneval": ("llama.cpp backend", "the same on HumanEval[:8]", None, XEON, None),
    "bench-auto-mixed": ("transformers backend", "`auto` against `ar` on transformers (bf16, exact on speculant's AMX "
                         "kernel), 2 repeats", None, XEON, None),
    "bench-auto-humaneval": ("transformers backend", "the same on HumanEval[:10], with the best hand-tuned `sd`", None,
                             XEON, None),
    "serve-1.5b-http-paired": ("serving", "`auto` against `ar` through HTTP, two servers side by side, passes paired "
                               "(`paired.md`, runs 1-4); one round beside `llama-server` (`5-with-llama-server`)",
                               "scripts/serve_paired.sh; scripts/serve_paired_summary.py", ZEN4, "b60349b"),
    "serve-1.5b-repeats": ("serving", "`auto` against `ar` in the serving engine without HTTP (`in-process.md`)",
                           "scripts/serve_engine.py", ZEN4, "6a045f8"),
    "serve-long-prompt.md": ("serving", "a 2000-token prompt beside a running stream: prefill in parts; prefill time "
                             "by "
                             "part size beside `llama-bench`", "scripts/serve_long_prompt.py; scripts/prefill_parts.py",
                             ZEN4, "c667f46"),
    "serve-0.5b": ("serving", "continuous batching against one request at a time, `auto` and `ar`, the 0.5B on "
                   "transformers", "speculant bench-serve --prompts prompts/mixed.jsonl --max-tokens 64 --requests R "
                   "--concurrency C --label L --out docs/results/serve-0.5b", XEON, None),
    "serve-0.5b-200": ("serving", "200 requests at C = 16 against the `auto` server, each checked against its solo run",
                       "speculant bench-serve --prompts prompts/mixed.jsonl --requests 200 --concurrency 16 "
                       "--max-tokens 64 --check-solo --out docs/results/serve-0.5b-200", XEON, None),
    "prefix-cache.md": ("serving", "the prefix cache: a follow-up turn's TTFT on the server that served the first "
                        "against a fresh one; conversations under load (serve-conversations)",
                        "python scripts/prefix_cache_ttft.py --repeats 3; scripts/serve_conversations.sh", ZEN5,
                        "d50ef63"),
    "serve-conversations": ("serving", "multi-turn conversations arriving open loop at 0.05 and 0.2 per second: "
                            "`auto` with the prefix cache, `ar` without it, `llama-server` with its cache",
                            "OUT=docs/results/serve-conversations scripts/serve_conversations.sh", ZEN5, None),
    "gpu.md": ("GPU", "the static backend compiled on an H200 (random weights), every table printed from the JSON "
               "of a lent GPU's call by `scripts/gpu_table.py`: T(W), `ar` against transformers' compiled `generate`, "
               "speculation, stage scheduling, batch rows, one-graph drafting, host syncs, `auto`; the H100's costs",
               "bash scripts/gpu_lent.sh", "NVIDIA H200, then an H100 (lent)", None),
    "gpu-h100.json": ("GPU", "an H100's T(W), `ar`, speculation and `auto` (26 Nov, before the later runs' fixes; "
                      "gpu.md's last tables)", "python scripts/gpu_static.py OUT.json",
                      "NVIDIA H100 80GB HBM3 (lent)", None),
    "gpu-h200-133a0c1.json": ("GPU", "every section of gpu_static.py in one call (4 Dec, at 133a0c1, the governor on "
                              "main): `auto` against `ar` where nothing is accepted (A B B A x 10), the CUDA tests, "
                              "T(W), `ar` against transformers' compiled `generate` (the README's table), speculation "
                              "with and without stage scheduling, one-graph drafting, batch rows, host syncs (gpu.md)",
                              "bash scripts/gpu_lent.sh --ab-repeats 10", "NVIDIA H200 (lent)", None),
    "auto-no-accept": ("speculation", "`auto` against `ar` where nothing is accepted, 1-2 ms a forward on the CPU "
                       "(random static models), A B B A with 95% intervals over rounds, in wall and CPU time: "
                       "results.json (Zen4, 1.07 ms a forward, 4 Dec); on the Zen3: "
                       "zen3-rest-{before,after}-{1,2}.json before and after a losing model candidate rests "
                       "REST_STEPS steps (one sitting, alternated); zen3-{before,after}-{1,2}.json at 73dfba0 "
                       "and after a plain step stopped being estimated dearer than the width verified last (then "
                       "at 3 layers and a 2048-position cache, 7-9 ms a forward)",
                       "python scripts/auto_no_accept.py docs/results/auto-no-accept/results.json", ZEN4, None),
    "auto-plan": ("speculation", "`auto` with its tree candidates at the execution plan's width (`tree_widths=auto`) "
                  "against the default width 2, beside `llama-completion`, mixed prompts and HumanEval[:10], 2 repeats",
                  None, ZEN4, None),
    "tree-breakdown": ("speculation", "Yggdrasil's breakdown (its Fig. 12) at this scale: chain speculation, then "
                       "equal-growth trees, the latency-aware objective, the hidden-state depth predictor, stage "
                       "scheduling, beside `llama-completion` in one run, with GPU projections "
                       "(`breakdown.md`, `scripts/gpu_projection.py`)", None, ZEN5, None),
    "draft-graph": ("speculation", "T(draft): a tree's levels in one call (one inductor graph compiled) against level "
                    "by level, on the static backend, eager and compiled (Yggdrasil's one-graph drafting)",
                    "python scripts/draft_graph.py docs/results/draft-graph/results.json --depths 2 4 8 --repeats 30",
                    ZEN5, None),
    "auto-per-request": ("CPU", "`auto` and `auto:catch_up=safe` against `ar` per request and per category "
                         "(decode), 24 mixed prompts, 4 long-context ones (1.7-3.2k tokens) and HumanEval[:20], 2 "
                         "repeats (`scripts/per_request.py`)",
                         None, ZEN5, None),
    "sampling-0.7": ("CPU", "`auto` with block verification and token by token against `ar` at temperature 0.7, "
                     "beside `llama-completion` at 0.7, 24 mixed prompts, 4 repeats", None, ZEN5, None),
    "sampling-verifiers": ("CPU", "`auto` with block verification and token by token against `ar` at temperatures "
                           "0.3, 0.7 and 1.0, in one run, 24 mixed prompts, 2 repeats", None, ZEN5, "0883034"),
    "prefill.md": ("CPU", "prompt evaluation of 512 tokens: the lean backend beside `llama-bench` (pp512), and what "
                   "bounds it", "python scripts/prefill_parts.py --lengths 512 --parts 512 --repeats 3; llama-bench "
                   "-p 512 -n 0 -r 2 -t 2 (-fa 1 -ctk bf16 -ctv bf16)", ZEN5, None),
    "lean-types": ("CPU", "`ar` on the lean backend against `ar` on llama.cpp and `llama-completion`, on a GGUF of "
                   "other types (SmolLM2-135M: Q4_1/Q8_0, after q4_b), 6 mixed prompts, 2 repeats",
                   "speculant bench --target smollm2-135m --methods ar:backend=lean ar:backend=llamacpp "
                   "llamacpp-cli-ar --prompts prompts/mixed.jsonl[:6] --max-new-tokens 96 --repeats 2", ZEN5, None),
    "lean-q5b": ("CPU", "Q5_0 on the lean backend's q5_b kernel: `ar` on lean against `ar` on llama.cpp and "
                 "`llama-completion` on the catalog's 0.5B (Q4_K/Q5_0/Q6_K/Q8_0), 6 mixed prompts, 2 repeats; "
                 "before.md: the same bench at the commit before (Q5_0 as q8_b, a byte per weight), the same sitting",
                 None, ZEN3, None),
    "lean-q5k": ("CPU", "Q5_K on the lean backend's q5_k kernel: `ar` and `auto` on lean against `ar` on llama.cpp and "
                 "`llama-completion`, on the 1.5B with its Q4_K matrices written again as Q5_K (`python "
                 "scripts/requantize_gguf.py MODEL.gguf /tmp/q5/qwen1.5b-q5k.gguf`, MODEL.gguf the catalog 1.5B's), 6 "
                 "mixed prompts, 2 repeats; before.md: the same bench at the commit before (Q5_K as q8_b, a byte per "
                 "weight), the same sitting", None, ZEN3, None),
    "lean-q5-avx512": ("CPU", "Q5_0 on AVX-512's own q5_b kernel: `ar` on lean against `llama-completion` on the "
                       "catalog's 0.5B (Q4_K/Q5_0/Q6_K/Q8_0), 6 mixed prompts, 2 repeats, A B B A with the commit "
                       "before (its AVX-512 path ran q5_b on AVX2's kernels): before.md, report.md, report-2.md, "
                       "before-2.md in that order; then HumanEval[:10], 128 tokens, one repeat: humaneval.md, "
                       "humaneval-before.md, humaneval-before-2.md, humaneval-2.md; T(W) of its 169 matrices on both "
                       "ISAs before and after (`speculant bench-kernels --model qwen2.5-coder-0.5b --widths "
                       "1,2,4,8,16 --isa avx512_vnni avx2 --repeats 20`, kernels-*.json, the same sitting)", None,
                       ZEN4, None),
    "tree-stage": ("speculation", "`tree` with stage scheduling against serial, mixed prompts and HumanEval[:10] "
                   "(hit rate and overlap: scripts/stage_record.py)", "speculant bench --methods ar "
                   "tree:drafter=qwen2.5-coder-0.5b@lean,depth=4,width=2 "
                   "tree:drafter=qwen2.5-coder-0.5b@lean,depth=4,width=2,schedule=stage --prompts "
                   "prompts/mixed.jsonl (and --dataset humaneval[:10]) --max-new-tokens 128 --out "
                   "docs/results/tree-stage/{mixed,humaneval}", "2-core AMD EPYC (AVX-512)", "d86464d"),
    "tree-objective": ("speculation", "`tree` with the speedup objective against accepted length only, and at "
                       "temperatures 0, 0.7 and 1.0, beside `llama-completion`, mixed prompts and HumanEval[:10] in one "
                       "run", None, ZEN5, None),
    "tree-plan": ("speculation", "`tree` with `width=auto` (the execution plan's width, then each tree's own after "
                  "its context) against width 2, beside `llama-completion`, mixed prompts and HumanEval[:10] in one run",
                  None, ZEN4, None),
    "tree-shapes": ("speculation", "equal-growth trees against Sequoia-style and N-way trees of the same 8 nodes "
                    "(Yggdrasil's Fig. 11 at this scale), beside `llama-completion`, mixed prompts and HumanEval[:10] "
                    "in one run", None, ZEN5, None),
    "auto-stage": ("speculation", "`auto` with stage scheduling against serial, beside `llama-completion`, mixed "
                   "prompts and HumanEval[:10] in one run (hit rate and overlap in the rows' stats)", None, ZEN5, None),
    "dsi-simulator.md": ("analysis", "DSI's theorems measured by the offline simulator on the paper's grid (7 servers "
                         "and 1)", "commands in the page", "any (a simulation)", None),
    "heatmap-paper": ("analysis", "the DSI paper's Figures 2 and 7 from the simulator, 7 servers",
                      "speculant simulate heatmap --out docs/results/heatmap-paper --ndim 100 --repeats 20 --servers 7",
                      "any (a simulation)", None),
    "heatmap-paper-1-server": ("analysis", "the same with one server",
                               "speculant simulate heatmap --out docs/results/heatmap-paper-1-server --ndim 100 "
                               "--repeats 10 --servers 1", "any (a simulation)", None),
    "dsi-online.md": ("analysis", "DSI in the latency twin through the real engine (online), against SI and non-SI",
                      "python scripts/dsi_online.py", ZEN4, None),
}


def git(*args: str) -> str:
    """git's output; hashes abbreviated to 7 digits, as the index writes them (git's own default grows with the
    repository's object count: 8 digits past 16384 objects, so a copy holding more objects would write other cells)."""
    return subprocess.run(["git", "-c", "core.abbrev=7", *args], capture_output=True, text=True, cwd=ROOT,
                          check=False).stdout.strip()


def facts(name: str) -> tuple[str, str, str]:
    """(command, machine, commit and date) from the entry's report.md and git."""
    path = RESULTS / name
    report = path / "report.md"
    text = report.read_text() if report.exists() else ""
    command = re.search(r"^Command: `(.*)`$", text, re.M)
    machine = re.search(r"^Machine: (.*)$", text, re.M)
    data = report if report.exists() else path
    commit = git("log", "--format=%h %ad", "--date=short", "-1", "--", str(data.relative_to(ROOT)))
    return command[1] if command else "", machine[1] if machine else "", commit


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that docs/results/index.md is what this "
                        "writes (its entries, and their commands, machines and commits)")
    args = parser.parse_args(argv)
    present = {p.name for p in RESULTS.iterdir() if p.name != "index.md"}
    missing, gone = sorted(present - set(ENTRIES)), sorted(set(ENTRIES) - present)
    for name in missing:
        print(f"not in ENTRIES: {name}", file=sys.stderr)
    for name in gone:
        print(f"in ENTRIES, not in docs/results: {name}", file=sys.stderr)
    if missing or gone:
        sys.exit(1)
    text = index()
    if not args.check:
        print(text, end="")
        return
    written = (RESULTS / "index.md").read_text() if (RESULTS / "index.md").is_file() else ""
    if not has_history(written):
        print("commits not checked: this repository lacks the history docs/results/index.md was written from "
              "(a shallow clone, a copy without git, or history rewritten)", file=sys.stderr)
        text, written = COMMIT_CELL.sub("| |", text), COMMIT_CELL.sub("| |", written)
    if text != written:
        first = next((pair for pair in zip(written.splitlines(), text.splitlines()) if pair[0] != pair[1]),
                     ("(" + plural(len(written.splitlines()), "line") + ")",
                      "(" + plural(len(text.splitlines()), "line") + ")"))
        sys.exit("docs/results/index.md is not what this writes: python scripts/results_index.py > "
                 "docs/results/index.md (or name an entry's data commit in ENTRIES where a commit only edited words)"
                 f"\n  written: {first[0]}\n  now:     {first[1]}")


# a row's commit cell: "| 1a2b3c4 2026-12-04 |", or empty where git gave nothing
COMMIT_CELL = re.compile(r"\| (?:[0-9a-f]{7,40} \d{4}-\d\d-\d\d)? \|(?= (?:[^|\\]|\\.)*\|$)", re.M)


def has_history(written: str) -> bool:
    """Whether git holds this repository's whole history, and in it every commit that `written` names."""
    if git("rev-parse", "--is-shallow-repository") != "false":
        return False
    named = sorted({match[1] for match in re.finditer(r"\| ([0-9a-f]{7,40}) \d{4}-\d\d-\d\d \|", written)})
    found = subprocess.run(["git", "cat-file", "--batch-check"], input="".join(f"{c}^{{commit}}\n" for c in named),
                           capture_output=True, text=True, cwd=ROOT, check=False)
    return found.returncode == 0 and "missing" not in found.stdout and "ambiguous" not in found.stdout


def index() -> str:
    lines = ["# Results\n",
             "Every entry of `docs/results/`, what it answers, and how it was made. Generated by "
             "`python scripts/results_index.py > docs/results/index.md`. Speed claims are ratios measured in one run; "
             "this VM's speed drifts between runs, so compare rows of one run only. Runs that later runs superseded "
             "are removed from the tree and listed in [CHANGELOG.md](../../CHANGELOG.md) with the commit that holds "
             "them (`git show COMMIT:docs/results/NAME/report.md`). Bench directories keep their `report.md` and most "
             "their raw rows (`results.json`); the others' rows were left out of the tree, and of git for some runs "
             "(`git log -- docs/results/NAME` shows what it holds).\n"]
    group = None
    for name, (g, what, command, machine, commit) in ENTRIES.items():
        if g != group:
            group = g
            lines += [f"\n## {g}\n", "| entry | what | command | commit, date | machine |", "|---|---|---|---|---|"]
        found_command, found_machine, found_commit = facts(name)
        if commit:
            found_commit = git("log", "--format=%h %ad", "--date=short", "-1", commit)
        link = f"[{name}]({name}/report.md)" if (RESULTS / name / "report.md").exists() else f"[{name}]({name})"
        if name == "serve-1.5b-http-paired":
            link = f"[{name}]({name}/paired.md)"
        elif name == "serve-1.5b-repeats":
            link = f"[{name}]({name}/in-process.md)"
        cmd = (command or found_command).replace("|", "\\|")
        if cmd.startswith(("speculant", "python", "scripts/")):
            cmd = "; ".join(f"`{part}`" for part in cmd.split("; "))
        mach = machine or found_machine
        if machine and found_machine:
            mach = f"{machine} (report: {found_machine.split(';')[0]})"
        mach = mach.replace("|", "\\|")
        lines.append(f"| {link} | {what} | {cmd} | {found_commit} | {mach} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])

"""The table of docs/results/dsi-online.md: `speculant simulate online` (the latency twin in pure mode through the
real engine) over the grid of servers x drafter latency x acceptance, every target forward padded to 30 ms, 50
tokens from the same 5 prompts per row, thread executor, lookahead from the planner; beside each DSI time the offline
simulator's on the very draws the run's DSI was decided by.

    python scripts/dsi_online.py > table.md
"""

from __future__ import annotations

import argparse

from speculant.analysis.online import simulate_online

SERVERS, DRAFTER_MS, ACCEPTANCES = (7, 3), (1.5, 3, 5), (0.6, 0.8, 0.93)


def main() -> None:
    print("| servers | drafter ms | a | lookahead | non-SI ms | SI (same k) ms | SI best k | SI best ms | DSI ms "
          "| offline DSI ms | DSI/SI | DSI/best SI | DSI/non-SI |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for servers in SERVERS:
        for drafter in DRAFTER_MS:
            for a in ACCEPTANCES:
                r = simulate_online(30, drafter, a, servers, tokens=50, repeats=5)
                assert r["identical_outputs"]
                print(f"| {servers} | {drafter:g} | {a:g} | {r['lookahead']} | {r['non_si_ms']:.0f} | {r['si_ms']:.0f} "
                      f"| {r['si_best_lookahead']} | {r['si_best_ms']:.0f} | {r['dsi_ms']:.0f} "
                      f"| {r['offline_dsi_ms']:.0f} | {r['dsi_speedup_over_si']:.2f}x "
                      f"| {r['dsi_speedup_over_best_si']:.2f}x | {r['dsi_speedup_over_non_si']:.2f}x |", flush=True)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # (it takes no arguments)
    main()

"""Renders `policyd bench --json` reports as one markdown table (benches/compare_python.sh)."""

import json
import sys


def ratio(report, pair, figure):
    for r in report["ratios"]:
        if r["pair"] == pair:
            for name, value in r["figures"]:
                if name == figure:
                    return value
    return None


def fmt(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


print(
    "| profile | load | server | p50 ms | p99 ms | p99.9 ms | req/s | engine ms/req | CPU ms/req | serving CPU ms/req | serving CPU vs floor | p50 vs floor |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    with open(path) as f:
        rep = json.load(f)
    run = rep["run"]
    load = (
        "1 conn, closed loop"
        if run["mode"] == "closed"
        else f"{run['connections']} conn × {run['rate_hz_per_connection']:g} Hz"
    )
    floor = next(t for t in rep["targets"] if t["name"] == "floor")
    for t in rep["targets"]:
        serving = t["serving_cpu_ms_per_request"]
        vs = (
            None
            if t["name"] == "floor" or serving is None
            else serving / floor["serving_cpu_ms_per_request"]
        )
        p50 = (
            None
            if t["name"] == "floor"
            else t["latency_ms"]["p50"] / floor["latency_ms"]["p50"]
        )
        l = t["latency_ms"]
        print(
            f"| {run['profile']} | {load} | {t['name']} | {fmt(l['p50'])} | {fmt(l['p99'])} | {fmt(l['p99_9'])} | "
            f"{t['throughput_rps']:.0f} | {fmt(t['engine_ms_per_request'])} | {fmt(t['cpu_ms_per_request'])} | "
            f"{fmt(serving)} | {fmt(vs, 2) + '×' if vs else '-'} | {fmt(p50, 2) + '×' if p50 else '-'} |"
        )

"""The served path with and without the engine channel (cluster/engine_channel.py),
in one run: ``specray bench serve`` on the same workload with its server
started with the replica's socket to rank 0 and with
``SPECRAY_ENGINE_CHANNEL=0`` (Ray actor calls alone), alternated; each of
those runs measures its own in-process engine beside its server.

    python bench/engine_channel.py --rounds 3 --out results/cpu_engine_channel_c1.json -- \\
        --target T --drafter D --device cpu --max-tokens 32 --concurrency 1 --temperatures 0 \\
        --drafter-modes on --limit 16 --num-requests 48

Everything after ``--`` goes to ``specray bench serve`` as it is (not
``--out`` or ``--plot``). ``--rounds`` alternates the modes that many
times. Prints and writes, per point, the medians: HTTP tok/s with the
channel over without it, each mode's HTTP / in-process ratio (each run
against its own in-process engine) and the legs between the replica and
rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specray import bench_serve

MODES = {"channel": "1", "ray_calls": "0"}


def run_mode(mode: str, serve_argv: list[str], out: Path) -> dict:
    before = os.environ.get("SPECRAY_ENGINE_CHANNEL")
    os.environ["SPECRAY_ENGINE_CHANNEL"] = MODES[mode]  # the server started by bench serve inherits it
    try:
        rc = bench_serve.main([*serve_argv, "--out", str(out), "--plot", str(out.with_suffix(".png"))])
    finally:
        if before is None:
            os.environ.pop("SPECRAY_ENGINE_CHANNEL", None)
        else:
            os.environ["SPECRAY_ENGINE_CHANNEL"] = before
    report = json.loads(out.read_text())
    report["exit_status"] = rc
    return report


LEGS = ("replica_to_engine_ms", "engine_to_replica_ms", "end_to_replica_ms")


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    """Per HTTP point, over each mode's rounds (medians): tok/s with the
    channel over Ray calls, HTTP / in-process of each mode (each round's own
    in-process run), and the legs between the replica and rank 0."""
    def key(p):
        return p["drafter"], p["temperature"], p["concurrency"]

    def by_point(reports, path):
        out: dict[tuple, list[dict]] = {}
        for r in reports:
            for p in r["points"]:
                if p["path"] == path:
                    out.setdefault(key(p), []).append(p)
        return out

    http = {m: by_point(r, "http") for m, r in runs.items()}
    inproc = {m: by_point(r, "inprocess") for m, r in runs.items()}
    rows = []
    for k in sorted(set(http["channel"]) & set(http["ray_calls"])):
        tok = {m: statistics.median(p["output_tok_s"] for p in http[m][k]) for m in MODES}
        row = {"drafter": k[0], "temperature": k[1], "concurrency": k[2],
               "http_channel_over_ray_calls": round(tok["channel"] / tok["ray_calls"], 4)}
        for m in MODES:
            pairs = list(zip(http[m][k], inproc[m].get(k, [])))
            if pairs:
                row[f"http_over_inprocess_{m}"] = round(statistics.median(
                    h["output_tok_s"] / i["output_tok_s"] for h, i in pairs), 4)
            for leg in LEGS:
                vals = [p["transport"][leg] for p in http[m][k] if (p.get("transport") or {}).get(leg) is not None]
                if vals:
                    row[f"{leg}_{m}"] = round(statistics.median(vals), 3)
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternated (medians compared)")
    args = p.parse_args(ours)
    if {"--out", "--plot"} & set(serve_argv):
        p.error("--out / --plot are this script's: leave them out of bench serve's arguments")
    t = time.perf_counter()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in args.modes:
                print(f"engine_channel: {mode}, round {i + 1} of {args.rounds}", flush=True)
                runs[mode].append(run_mode(mode, serve_argv, Path(tmp) / f"{mode}_{i}.json"))
    report = {"command": "python bench/engine_channel.py " + shlex.join(argv),
              "note": "each mode is one `specray bench serve` run (its own server and in-process engine); "
                      "SPECRAY_ENGINE_CHANNEL in the server's environment picks the replica's transport",
              "comparison": compare(runs) if len(runs) == 2 else [], "runs": runs,
              "elapsed_s": round(time.perf_counter() - t, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for row in report["comparison"]:
        print("engine_channel:", ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    print(f"engine_channel: wrote {args.out} in {report['elapsed_s']:.0f} s", flush=True)
    return report


if __name__ == "__main__":
    main()

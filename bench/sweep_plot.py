"""The concurrency sweep's picture (bench/concurrency_sweep.py): each
series' tokens/s, speculative and autoregressive, and their ratio."""

from __future__ import annotations


def policy_of(p: dict) -> str:
    """A point's policy; points written before the field had oracle runs on
    fixed chains (the oracle then required it) and the embedded pair on the
    engine's adaptive default."""
    return p.get("policy") or ("fixed" if p.get("oracle_acceptance") else "adaptive")


def plot(report: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series: dict[tuple, list] = {}
    for p in report["points"]:
        series.setdefault((p["model"], p.get("oracle_acceptance"), policy_of(p), p["temperature"]), []).append(p)
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    xs_all = sorted({p["concurrency"] for p in report["points"]})
    for (model, oracle, policy, temp), pts in sorted(series.items(), key=str):
        pts.sort(key=lambda p: p["concurrency"])
        name = f"{model}" + (f" [oracle {oracle}]" if oracle else "") + f" {policy} T={temp:g}"
        xs = [p["concurrency"] for p in pts]
        line, = ax.plot(xs, [p["spec_tok_s"] for p in pts], marker="o", label=f"{name} spec")
        ax.plot(xs, [p["ar_tok_s"] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                label=f"{name} AR")
        # the point's figure: the median of its paired run ratios (the tok/s are each side's median run)
        rx.plot(xs, [p.get("speedup") or p["spec_tok_s"] / p["ar_tok_s"] for p in pts], marker="o",
                color=line.get_color(), label=name)
    for a in (ax, rx):
        a.set_xscale("log", base=2)
        a.set_xticks(xs_all, [str(x) for x in xs_all])
        a.set_xlabel("requests in flight (closed loop)")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("output tokens/s")
    rx.axhline(1.0, color="grey", linewidth=0.8)
    rx.set_ylabel("spec / AR")
    oracles = sorted({str(p.get("oracle_acceptance")) for p in report["points"] if p.get("oracle_acceptance")})
    fig.suptitle("speculative vs autoregressive, in process"
                 + (f" | oracle_acceptance: {', '.join(oracles)} (oracle points: system throughput at that "
                    "acceptance, not a drafter's quality)" if oracles else ""), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True

"""Host wall time of the engine's named functions, per ``step()`` call of
each kind, for finding where a step's host time goes (``bench/load_profile.py
--phases``; ``SPECRAY_PHASES=1`` in a server's environment puts one on its
engine and ``specray bench serve`` reports it per point).

No syncs are added: a phase that launches GPU work costs its launch, one
that reads results back its wait. A ``step()`` call is a ``join`` (requests
joined the running chain), ``sync`` (a synchronous step: a prefill, a
chain's start) or ``async`` (asynchronous cycles only). A function called
inside a join is counted as ``name (in join_chain)``. Each timed call costs
~1 us of its own, so a phased run is a little slower than a clean one.
"""

from __future__ import annotations

import time
from collections import Counter

KINDS = ("join", "sync", "async")


class PhaseTimer:
    def __init__(self, eng):
        import specray.engine as engine_module
        from specray import async_decode, chain_admit, step_buffers, sync_accept
        from specray.actors import graphs

        self.eng, self._in_join, self._undo = eng, False, []
        self.ms: Counter = Counter()  # (kind, name) -> total ms; kind "pending" until its step() ends
        self.cycles: Counter = Counter()  # kind -> step() calls
        # The engine's own methods are wrapped on the instance (another
        # engine of the process is untouched); module functions and the
        # helpers' methods for the process, until close().
        for name in ("_target_batch", "_accept", "_apply", "_apply_inflight", "speculate", "_join_lanes",
                     "_can_chain", "_sync_step", "_logprob_rows", "_emit", "store_context", "_shape_admission",
                     "add_request", "_observe_cycle", "_count_cycle"):
            if hasattr(eng, name):
                self._wrap(eng, name, instance=True)
        self._wrap(eng.scheduler, "schedule", instance=True)
        self._wrap(eng.scheduler, "admit_whole", instance=True)
        self._wrap(eng.target, "execute", instance=True)
        for owner, name in ((engine_module, "chain_from_prefill"), (chain_admit, "_store_prompts"),
                            (async_decode, "launch_decode"), (async_decode, "join_rows"),
                            (sync_accept.AcceptedOnDevice, "read"), (async_decode.InflightStep, "wait"),
                            (async_decode.InflightStep, "gpu_seconds"), (graphs.DecodeGraphs, "run"),
                            (step_buffers.ResultBuffers, "fetch")):
            self._wrap(owner, name)
        self._wrap(chain_admit, "join_chain", join=True)
        # engine.py calls join_chain and launch_decode by the names it imported
        for owner, name in ((chain_admit, "join_chain"), (async_decode, "launch_decode")):
            self._undo.append((engine_module, name, getattr(engine_module, name), False))
            setattr(engine_module, name, getattr(owner, name))
        self._wrap(eng, "step", step=True, instance=True)

    def _wrap(self, owner, name, join=False, step=False, instance=False):
        fn = getattr(owner, name)
        self._undo.append((owner, name, fn, instance))
        timer = self

        def timed(*a, **k):
            t = time.perf_counter()
            if join:
                timer._in_join = True
            joins = timer.eng.num_chain_joins
            try:
                return fn(*a, **k)
            finally:
                dt = 1000 * (time.perf_counter() - t)
                if step:
                    timer._end_step(dt, timer.eng.num_chain_joins > joins)
                else:
                    timer.ms[("pending", name + (" (in join_chain)" if timer._in_join and not join else ""))] += dt

        setattr(owner, name, timed)

    def _end_step(self, dt: float, joined: bool) -> None:
        kind = "join" if joined else "sync" if ("pending", "_sync_step") in self.ms else "async"
        self.cycles[kind] += 1
        self.ms[(kind, "step")] += dt
        for key in [k for k in self.ms if k[0] == "pending"]:
            self.ms[(kind, key[1])] += self.ms.pop(key)
        self._in_join = False

    def totals(self) -> dict:
        """{kind: {"cycles": n, "ms": {name: total ms}}} so far (two of
        them subtract: ``per_cycle(after, before)``)."""
        ms = dict(self.ms)  # the engine thread may add to it meanwhile
        return {kind: {"cycles": self.cycles[kind],
                       "ms": {name: round(v, 4) for (k, name), v in ms.items() if k == kind}} for kind in KINDS}

    def close(self) -> None:
        for owner, name, fn, instance in reversed(self._undo):
            if instance:
                delattr(owner, name)  # the class's method shows through again
            else:
                setattr(owner, name, fn)
        self._undo.clear()


def per_cycle(after: dict, before: dict | None = None) -> dict:
    """Mean ms per ``step()`` call of each kind, from ``totals()`` (the
    difference of two when ``before`` is given), largest first."""
    out = {}
    for kind in KINDS:
        a, b = after.get(kind) or {}, (before or {}).get(kind) or {}
        n = a.get("cycles", 0) - b.get("cycles", 0)
        rows = {name: round((v - (b.get("ms") or {}).get(name, 0.0)) / n, 4)
                for name, v in (a.get("ms") or {}).items()} if n > 0 else {}
        out[kind] = {"cycles": n, "ms_per_cycle": dict(sorted(rows.items(), key=lambda kv: -kv[1]))}
    return out

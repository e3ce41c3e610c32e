"""A test hook: make chosen requests fail inside the step.

``EngineConfig(extra={"fault_injection": {"seed": 666, "where": "step"}})``
(or a list of such settings) marks every request whose
``SamplingParams.seed`` is 666 (every transport carries a seed, and it does
not change a greedy request's tokens). While a marked request is running:

* ``"step"``: the target's forward raises (a step-wide error: the engine
  must find the request by retrying without it);
* ``"nan"``: the target's logits come back NaN (all rows of the step);
* ``"append"``: appending its own tokens raises (its host code);
* ``"hang"``: the target's forward sleeps ``hang_s`` seconds (a stuck step).

And, for every request, ``{"where": "pace_degraded", "step_s": 0.25}``:
steps take at least ``step_s`` while the engine has no drafter, so that a
test's requests outlast a new drafter's start.

Nothing is installed without the setting.
"""

from __future__ import annotations

import time

_WHERE = ("step", "nan", "append", "hang", "pace_degraded")


def hooks(engine):
    """``(before, after)`` for the target's ``GuardedTarget`` (None where
    nothing is injected there); "append" faults are patched into the
    engine here."""
    specs = (engine.config.extra or {}).get("fault_injection")
    if not specs:
        return None, None
    specs = specs if isinstance(specs, list) else [specs]
    for spec in specs:
        if not isinstance(spec, dict) or spec.get("where") not in _WHERE or \
                ("seed" not in spec and spec.get("where") != "pace_degraded"):
            raise ValueError(f"fault_injection takes {{'seed': int, 'where': one of {_WHERE}}} (or a list of them), "
                             f"got {spec!r}")

    def running(where: str):
        seeds = {s.get("seed") for s in specs if s["where"] == where}
        return [r for r in engine.scheduler.running if r.params.seed in seeds]

    failing = {s["seed"] for s in specs if s["where"] == "append"}
    pace = max((float(s.get("step_s", 0.25)) for s in specs if s["where"] == "pace_degraded"), default=0.0)
    if failing:
        append = engine._append

        def failing_append(r, tokens, logprobs=None):
            if r.params.seed in failing:
                raise RuntimeError(f"injected failure appending to request {r.request_id}")
            return append(r, tokens, logprobs)

        engine._append = failing_append

    def before(batch):
        if pace and engine.drafter is None:
            time.sleep(pace)
        hung = running("hang")
        if hung:
            seed = hung[0].params.seed
            time.sleep(float(next(s.get("hang_s", 3600) for s in specs if s.get("seed") == seed)))
        if running("step"):
            raise RuntimeError("injected step failure")

    def after(logits):
        return logits * float("nan") if running("nan") else logits

    wheres = {s["where"] for s in specs}
    return (before if wheres & {"step", "hang", "pace_degraded"} else None), (after if "nan" in wheres else None)

"""A test hook: make chosen requests fail inside the step.

``EngineConfig(extra={"fault_injection": {"seed": 666, "where": "step"}})``
marks every request whose ``SamplingParams.seed`` is 666 (any transport
carries a seed, and it does not change a greedy request's tokens). While a
marked request is running:

* ``"step"``: the target's forward raises (a step-wide error: the engine
  must find the request by retrying without it);
* ``"nan"``: the target's logits come back NaN (all rows of the step);
* ``"append"``: appending its own tokens raises (its host code);
* ``"hang"``: the target's forward sleeps ``hang_s`` seconds (a stuck step).

Nothing is installed without the setting.
"""

from __future__ import annotations

import time


def hooks(engine):
    """``(before, after)`` for the target's ``GuardedTarget`` (None, None
    when the engine has no fault injection); an "append" fault is patched
    into the engine here."""
    spec = (engine.config.extra or {}).get("fault_injection")
    if not spec:
        return None, None
    if not isinstance(spec, dict) or spec.get("where") not in ("step", "nan", "append", "hang"):
        raise ValueError(f"fault_injection must be {{'seed': int, 'where': 'step' | 'nan' | 'append' | 'hang'}}, "
                         f"got {spec!r}")
    seed, where = spec.get("seed"), spec["where"]

    def marked(r) -> bool:
        return r.params.seed == seed

    def any_running() -> bool:
        return any(marked(r) for r in engine.scheduler.running)

    if where == "append":
        append = engine._append

        def failing_append(r, tokens, logprobs=None):
            if marked(r):
                raise RuntimeError(f"injected failure appending to request {r.request_id}")
            return append(r, tokens, logprobs)

        engine._append = failing_append
        return None, None
    if where == "nan":
        return None, lambda logits: logits * float("nan") if any_running() else logits

    def before(batch):
        if not any_running():
            return
        if where == "hang":
            time.sleep(float(spec.get("hang_s", 3600)))
        else:
            raise RuntimeError("injected step failure")

    return before, None

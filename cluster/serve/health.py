"""What a replica says of its engine, from ``AsyncEngine.health()``.

* ``/health``: 200 ``{"status": "ok"}``; 200 ``{"status": "degraded"}``
  while the drafter is down (requests are served, autoregressively, and a
  new drafter is on its way) or given up; 503 ``{"status": "unavailable"}``
  while the engine is rebuilt after a lost target rank, or cannot serve.
* Serve's ``check_health`` raises, so that Serve replaces the replica, when
  the engine will not recover by itself: its rebuild failed or has run past
  ``rebuild_grace_s``, rank 0 does not answer, or one step has run longer
  than ``stuck_step_s`` (a hung collective: gloo's own timeout is 30
  minutes). A degraded drafter is not a reason: the replica still serves.
"""

from __future__ import annotations


def _last_line(text: str | None) -> str | None:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else None


def http_health(h: dict) -> tuple[int, dict]:
    """Status code and body of ``/health``."""
    engine = h.get("engine", "ok")
    if engine != "ok" or h.get("loop", "running") != "running":
        return 503, {"status": "unavailable", "engine": engine if engine != "ok" else h.get("loop"),
                     "error": _last_line(h.get("failure"))}
    drafter = h.get("drafter") or {}
    if drafter.get("state") in ("down", "failed"):
        return 200, {"status": "degraded", "drafter": drafter["state"], "drafter_losses": drafter.get("losses"),
                     "error": _last_line(drafter.get("error"))}
    return 200, {"status": "ok"}


def check(h: dict, stuck_step_s: float, rebuild_grace_s: float) -> None:
    """Raise where the replica should be replaced."""
    engine = h.get("engine", "ok")
    if engine == "failed":
        raise RuntimeError(f"the engine cannot be rebuilt: {_last_line(h.get('failure'))}")
    if engine == "unresponsive":
        raise RuntimeError("the engine's rank 0 does not answer")
    if engine == "rebuilding" and h.get("rebuilding_s", 0.0) > rebuild_grace_s:
        raise RuntimeError(f"the engine has been rebuilding for {h['rebuilding_s']:.0f} s")
    if h.get("loop", "running") == "stopped":
        raise RuntimeError("the engine's step loop has stopped")
    running = h.get("step_running_s", 0.0)
    if running > stuck_step_s:
        raise RuntimeError(f"an engine step has run for {running:.0f} s (bound {stuck_step_s:g} s): stuck")

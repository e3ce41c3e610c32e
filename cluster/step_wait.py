"""Bounded waits for step results that a drafter in another process sends
or receives over NCCL.

The drafter's headers travel over the gloo pair, whose waits time out; its
tensors travel over NCCL, whose sends and receives do not: a drafter that
dies with one of them queued on rank 0's stream leaves every later event of
that stream pending, and ``Event.synchronize()`` never returns. So rank 0
polls the step's event, and past ``drafter_timeout_s`` aborts the
communicator (``ncclCommAbort`` makes the queued NCCL kernels return, their
buffers holding whatever was there), then waits a short bound for the
stream to drain: drained, the step's results are garbage and the drafter is
lost (``DrafterLost``: the steps in flight are dropped and recomputed
without it); still stuck, only a new group can run steps (``GroupLost``).

Only that placement pays the polling: a drafter in rank 0's process, or one
whose tensors travel over gloo, keeps a plain ``synchronize()``.
"""

from __future__ import annotations

import time

import torch

from specray.faults import DrafterLost, GroupLost

# After the abort the queued NCCL kernels return at once; a stream still
# busy after this long is stuck on something the abort does not reach.
ABORT_GRACE_S = 5.0
# A step whose graph rank 0 captured may also wait for the drafter's own
# first capture of its half (and its kernels' first compilation).
CAPTURE_TIMEOUT_S = 150.0


def _poll(event, timeout_s: float, clock=time.monotonic, sleep=time.sleep) -> bool:
    """Whether ``event`` completed within ``timeout_s``. The first pauses are
    short, so a step that is nearly done costs little latency; they grow to
    1 ms so that a long step costs little host time."""
    deadline = clock() + timeout_s
    pause = 20e-6
    while not event.query():
        if clock() >= deadline:
            return False
        sleep(pause)
        pause = min(2 * pause, 1e-3)
    return True


def wait_ready(event, timeout_s: float, on_timeout, drain=None, abort_grace_s: float = ABORT_GRACE_S,
               clock=time.monotonic, sleep=time.sleep) -> None:
    """Wait for ``event`` at most ``timeout_s``; past it call ``on_timeout``
    (the abort) and give the stream ``abort_grace_s`` to drain: ``drain()``,
    an event after everything queued so far (steps launched after this one
    hold NCCL kernels of the same communicator), or ``event`` itself.
    Raises ``DrafterLost`` when it drains (the results must not be
    applied), ``GroupLost`` when it does not."""
    if _poll(event, timeout_s, clock, sleep):
        return
    stuck = f"the drafter's NCCL exchange did not complete within {timeout_s:g} s"
    done = _abort_and_drain(on_timeout, drain() if drain is not None else event, stuck, abort_grace_s, clock, sleep)
    if done:
        raise DrafterLost(f"{stuck}: its communicator was aborted and the step's results dropped")
    raise GroupLost(f"{stuck}, and the CUDA stream was still stuck {abort_grace_s:g} s after aborting its "
                    f"communicator: the group must be rebuilt")


def _abort_and_drain(abort, drained, what: str, grace_s: float, clock=time.monotonic, sleep=time.sleep) -> bool:
    """``abort()``, then whether ``drained`` (an event, or None: nothing to
    wait for) completes within ``grace_s``."""
    try:
        abort()
    except Exception as e:  # the stream is as stuck as before
        raise GroupLost(f"{what}, and aborting the drafter's NCCL communicator failed ({e}): the group must be "
                        f"rebuilt") from e
    try:
        return drained is None or _poll(drained, grace_s, clock, sleep)
    except Exception as e:
        # The kernels that read the aborted receives' buffers may have
        # faulted on what they held: the CUDA context is gone with them.
        raise GroupLost(f"{what}; after its communicator was aborted the device failed ({e}): the group must be "
                        f"rebuilt") from e


def stream_event(device) -> torch.cuda.Event:
    """An event after everything queued so far on ``device``'s current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _drain(core):
    return (lambda: stream_event(core.device)) if core.device.type == "cuda" else None


def result_wait(core, captured: bool = False):
    """How the engine waits for a step's results: None (a plain
    ``synchronize()``) unless its drafter exchanges tensors with this
    process over NCCL, else a bounded ``wait_ready``. ``captured``: rank 0
    captured the step's graph as it launched it."""
    abort = getattr(core.drafter, "data_abort", None)
    if abort is None:
        return None
    timeout = core.config.drafter_timeout_s
    if captured:
        timeout = max(timeout, CAPTURE_TIMEOUT_S)
    drain = _drain(core)
    return lambda event: wait_ready(event, timeout, abort, drain)


def abort_lost_drafter(core, drafter) -> None:
    """A drafter lost for any reason (a header's timeout, a failed word, a
    failed re-seed) may leave NCCL kernels of its exchanges queued on rank
    0's stream, which the next step's plain ``synchronize()`` would wait on
    forever: abort its communicator and see the stream drain (``GroupLost``
    if it does not)."""
    abort = getattr(drafter, "data_abort", None)
    if abort is None:
        return
    drain = _drain(core)
    what = "the drafter was lost"
    if not _abort_and_drain(abort, drain() if drain is not None else None, what, ABORT_GRACE_S):
        raise GroupLost(f"{what}, and the CUDA stream was still stuck {ABORT_GRACE_S:g} s after aborting its NCCL "
                        f"communicator: the group must be rebuilt")

"""Rank 0's bounded wait for step results that cross NCCL to a drafter in
another process (cluster/step_wait.py). NCCL has no timeout: a drafter that
dies with a send or receive queued leaves the step's event pending forever.
Past ``drafter_timeout_s`` rank 0 aborts the communicator; a stream that
then drains is a drafter loss (the results are dropped, the steps go on
autoregressively), one that stays stuck is the group's loss.

On the CPU, with fakes: the events and the communicator are stand-ins, and
the engine tests give an in-process drafter an ``data_abort`` so that the
engine waits as it does for a separate drafter over NCCL. The abort path
has not run on GPUs (it needs two)."""

import pytest
import torch

from specray import LLM
from specray import engine as engine_mod
from specray import step_wait as W
from specray.actors.transport import CupyNcclChannel, SplitChannel, TorchP2PChannel
from specray.actors.remote_drafter import RemoteDrafter
from specray.engine import EngineCore
from specray.faults import DrafterLost, GroupLost, GuardedDrafter
from factories import make_models
from test_faults import ASYNC, GREEDY, KW, PROMPTS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("step_wait"))


@pytest.fixture(scope="module")
def want(models):
    return [o.token_ids for o in LLM(models / "t", models / "d", **KW).generate(PROMPTS, GREEDY)]


class Event:
    """A CUDA event's stand-in: done after ``after`` queries, or never
    (None) until something sets ``done``."""

    def __init__(self, after=None):
        self.after, self.queries, self.done = after, 0, False

    def query(self) -> bool:
        self.queries += 1
        if self.after is not None and self.queries > self.after:
            self.done = True
        return self.done

    def synchronize(self):
        if not self.done:
            raise AssertionError("a plain synchronize() on an NCCL exchange that never completes blocks forever")


class Comm:
    """The NCCL communicator's stand-in: ``abort()`` makes ``unblocks``
    complete, unless it stays stuck."""

    def __init__(self, unblocks=(), stuck=False, fails=False):
        self.unblocks, self.stuck, self.fails, self.aborts = list(unblocks), stuck, fails, 0

    def abort(self):
        self.aborts += 1
        if self.fails:
            raise RuntimeError("ncclCommAbort failed")
        if not self.stuck:
            for e in self.unblocks:
                e.done = True


def test_a_step_that_completes_is_returned_without_abort():
    event, comm = Event(after=3), Comm()
    W.wait_ready(event, 1.0, comm.abort)
    assert comm.aborts == 0 and event.queries == 4


def test_a_step_stuck_until_the_abort_is_a_drafter_loss():
    event = Event()
    comm = Comm([event])
    with pytest.raises(DrafterLost, match="aborted and the step's results dropped"):
        W.wait_ready(event, 0.05, comm.abort, abort_grace_s=1.0)
    assert comm.aborts == 1 and event.done


def test_a_stream_stuck_after_the_abort_is_the_groups_loss():
    event = Event()
    comm = Comm([event], stuck=True)
    with pytest.raises(GroupLost, match="still stuck 0.05 s after aborting"):
        W.wait_ready(event, 0.05, comm.abort, abort_grace_s=0.05)
    assert comm.aborts == 1


def test_the_stream_must_drain_not_only_the_step():
    """A step launched after the stuck one holds NCCL kernels too: the
    drafter is lost only once everything queued has run."""
    event, later = Event(), Event()
    comm = Comm([event])  # ``later`` stays pending
    with pytest.raises(GroupLost):
        W.wait_ready(event, 0.05, comm.abort, drain=lambda: later, abort_grace_s=0.05)
    later = Event()
    with pytest.raises(DrafterLost):
        W.wait_ready(Event(), 0.05, Comm([later]).abort, drain=lambda: later, abort_grace_s=1.0)


def test_a_failed_abort_or_a_device_fault_after_it_is_the_groups_loss():
    comm = Comm(fails=True)
    with pytest.raises(GroupLost, match="aborting the drafter's NCCL communicator failed"):
        W.wait_ready(Event(), 0.05, comm.abort)

    class Faulted(Event):
        def query(self):
            if comm.aborts:
                raise RuntimeError("CUDA error: device-side assert triggered")
            return False

    comm = Comm()
    with pytest.raises(GroupLost, match="the device failed"):
        W.wait_ready(Faulted(), 0.05, comm.abort)


def test_polling_starts_short_and_grows_to_a_millisecond():
    pauses, now = [], [0.0]

    def sleep(s):
        pauses.append(s)
        now[0] += s

    assert not W._poll(Event(), 0.01, clock=lambda: now[0], sleep=sleep)
    assert pauses[0] == pytest.approx(20e-6) and pauses[1] == pytest.approx(40e-6)
    assert max(pauses) == pytest.approx(1e-3) and pauses[-1] == pytest.approx(1e-3)


def test_only_an_nccl_data_channel_is_aborted():
    nccl = CupyNcclChannel.__new__(CupyNcclChannel)  # no GPU here: the fields abort() and SplitChannel read
    comm = nccl.comm = Comm()
    nccl.device = torch.device("cpu")
    nccl.abort()
    nccl.abort()  # once is all NCCL allows
    assert comm.aborts == 1 and nccl.comm is None
    nccl.comm = Comm()
    gloo = TorchP2PChannel(1)
    split = SplitChannel(gloo, nccl)
    drafter = GuardedDrafter(RemoteDrafter(split, torch.device("cpu")))
    assert drafter.data_abort == nccl.abort
    assert SplitChannel(gloo, TorchP2PChannel(1, tag=1)).data_abort is None
    assert GuardedDrafter(RemoteDrafter(SplitChannel(gloo, TorchP2PChannel(1, tag=1)), "cpu")).data_abort is None


def test_the_engine_waits_plainly_unless_the_drafter_talks_nccl(models, monkeypatch):
    llm = LLM(models / "t", models / "d", **KW, drafter_timeout_s=7.0)
    assert W.result_wait(llm.engine) is None  # in process: plain synchronize()
    seen = []
    monkeypatch.setattr(W, "wait_ready", lambda event, timeout, abort, drain: seen.append((timeout, abort)))
    llm.engine.drafter.data_abort = abort = object()
    W.result_wait(llm.engine)(Event())
    W.result_wait(llm.engine, captured=True)(Event())
    assert seen == [(7.0, abort), (W.CAPTURE_TIMEOUT_S, abort)]


def stuck_at(n: int, comm: Comm):
    """The ``n``-th call gets an event that never completes (until the
    abort) and garbage results, which must not be applied."""
    calls = []

    def mark(results):
        calls.append(1)
        if len(calls) != n:
            return None
        results.fill_(1)
        event = Event()
        comm.unblocks.append(event)
        return event

    return mark


def test_an_async_step_stuck_on_nccl_is_a_drafter_loss_and_tokens_are_kept(models, want, monkeypatch):
    """The drafter dies with an exchange of an async step graph queued:
    rank 0 aborts its communicator past the timeout, drops the steps in
    flight (their results are garbage) and goes on autoregressively; a new
    drafter is re-seeded, and the tokens are the run without the fault's."""
    llm = LLM(models / "t", models / "d", **KW, **ASYNC, drafter_timeout_s=0.2)
    first = llm.engine.drafter.inner
    comm = Comm()
    llm.engine.drafter.data_abort = comm.abort
    mark, launch = stuck_at(4, comm), engine_mod.launch_decode

    def launch_stuck(core, requests, chained, **kw):
        step = launch(core, requests, chained, **kw)
        step.ready = mark(step.results) or step.ready
        return step

    monkeypatch.setattr(engine_mod, "launch_decode", launch_stuck)
    got = llm.generate(PROMPTS, GREEDY)
    assert comm.unblocks and all(e.done for e in comm.unblocks) and comm.aborts >= 1
    assert [o.token_ids for o in got] == want
    state = llm._faults.drafter
    assert (state.state, state.losses, state.restarts) == ("up", 1, 1) and "NCCL exchange" in state.error
    assert llm.engine.drafter.inner is not first


def test_a_sync_step_stuck_on_nccl_is_a_drafter_loss_and_tokens_are_kept(models, want, monkeypatch):
    """The same in a synchronous step (its proposal and context exchange):
    its results are read after the verify, and nothing of the step was
    applied before the read raised."""
    llm = LLM(models / "t", models / "d", **KW, drafter_timeout_s=0.2)
    comm = Comm()
    llm.engine.drafter.data_abort = comm.abort
    mark, accept = stuck_at(5, comm), EngineCore._accept

    def accept_stuck(self, decode, *a):
        out = accept(self, decode, *a)
        if decode:
            out.ready = mark(out.host) or out.ready
        return out

    monkeypatch.setattr(EngineCore, "_accept", accept_stuck)
    got = llm.generate(PROMPTS, GREEDY)
    assert comm.unblocks and comm.unblocks[0].done
    assert [o.token_ids for o in got] == want
    assert llm._faults.drafter.losses == 1 and "NCCL exchange" in llm._faults.drafter.error


def test_an_async_step_still_stuck_after_the_abort_loses_the_group(models, monkeypatch):
    llm = LLM(models / "t", models / "d", **KW, **ASYNC, drafter_timeout_s=0.1)
    comm = Comm(stuck=True)
    llm.engine.drafter.data_abort = comm.abort
    mark, launch = stuck_at(3, comm), engine_mod.launch_decode
    monkeypatch.setattr(W, "ABORT_GRACE_S", 0.1)

    def launch_stuck(core, requests, chained, **kw):
        step = launch(core, requests, chained, **kw)
        step.ready = mark(step.results) or step.ready
        return step

    monkeypatch.setattr(engine_mod, "launch_decode", launch_stuck)
    with pytest.raises(GroupLost, match="the group must be rebuilt"):
        llm.generate(PROMPTS, GREEDY)
    assert comm.aborts == 1 and llm._faults.drafter.losses == 0


def test_any_drafter_loss_aborts_its_nccl_exchanges(models, want):
    """A drafter lost elsewhere (a header's timeout in its propose) may
    leave NCCL kernels queued that the next step's sync would wait on."""
    llm = LLM(models / "t", models / "d", **KW)
    inner, comm, calls = llm.engine.drafter.inner, Comm(), []
    llm.engine.drafter.data_abort = comm.abort

    def propose(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("no header within drafter_timeout_s")
        return type(inner).propose(inner, batch)

    inner.propose = propose
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert comm.aborts == 1 and llm._faults.drafter.losses == 1


def test_a_new_drafter_lost_while_re_seeded_is_aborted_too(models, want):
    """Re-seeding sends a new drafter its context over NCCL before it is
    installed: its loss there aborts its communicator, not the old one's."""
    llm = LLM(models / "t", models / "d", **KW)
    inner, calls, comm, made = llm.engine.drafter.inner, [], Comm(), []

    def propose(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the first drafter is gone")
        return type(inner).propose(inner, batch)

    def failing_store(*a):
        raise RuntimeError("the new drafter's channel broke")

    inner.propose = propose
    restart = llm._faults.restart

    def first_new_one_fails():
        new = restart()
        made.append(new)
        if len(made) == 1:
            new.data_abort, new.store_context = comm.abort, failing_store
        return new

    llm._faults.restart = first_new_one_fails
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    state = llm._faults.drafter
    assert comm.aborts == 1 and (state.state, state.losses, state.restarts) == ("up", 2, 1)

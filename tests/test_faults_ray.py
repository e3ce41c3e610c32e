"""Faults of the Ray backend on a local CPU cluster (loopback): a drafter
actor killed, stuck or raising is replaced while every request goes on and
ends with the tokens of a run without the fault; a target rank killed
fails the requests in flight at once as the engine's, and the group is
rebuilt with nothing of the old one left alive; a request that breaks the
step fails alone."""

import dataclasses
import os
import signal
import threading
import time

import pytest

from factories import make_models
from specray import LLM, SamplingParams
from specray.faults import EngineUnavailable

ray = pytest.importorskip("ray")

PROMPTS = [[5, 17, 33, 2, 9, 10, 42], [3, 4], list(range(2, 40)), [7] * 15, [11, 12, 13], [20, 21, 22],
           [30, 31], [40, 41, 42, 43]]
LONG = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
KW = dict(num_kv_blocks=800, kv_block_size=4, drafter_timeout_s=3.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ray.init(address="local", num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR")
    yield make_models(tmp_path_factory.mktemp("faults_ray"))
    ray.shutdown()


def reference(llm, which=("long", "short")) -> dict:
    """The engine's outputs before any fault (the run to compare with)."""
    return {k: llm.generate(PROMPTS, LONG if k == "long" else SHORT) for k in which}


def pace_while_drafter_down(llm, step_s: float = 0.25):
    """Slow rank 0's steps while its drafter is down, so that the requests
    outlast the new drafter's start (a second or ten on a busy CI machine)
    and it is re-seeded with their context."""
    def patch(self):
        import time as _time

        execute, faults = self.worker.execute, self.loop.faults

        def paced(batch):
            end = _time.monotonic() + step_s
            while faults.drafter.state == "down" and _time.monotonic() < end:
                _time.sleep(0.01)
            return execute(batch)

        self.worker.execute = paced

    ray.get(llm._core.driver.__ray_call__.remote(patch))


def actor_table() -> dict:
    import ray._private.state

    return ray._private.state.actors()


def pid_of(handle) -> int:
    return actor_table()[handle._actor_id.hex()]["Pid"]


def when_stepping(llm, action, steps: int = 4):
    """Run ``action`` in a thread once the engine has run ``steps`` steps."""
    box = {}

    def run():
        end = time.monotonic() + 60
        while llm.stats()["num_steps"] < steps and time.monotonic() < end:
            time.sleep(0.02)
        box["t"] = time.monotonic()
        action()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def wait_drafter_up(llm, timeout_s=60.0) -> dict:
    end = time.monotonic() + timeout_s
    while (st := llm.stats())["drafter"]["state"] != "up" or st["drafter"]["losses"] == 0:
        assert time.monotonic() < end, st["drafter"]
        time.sleep(0.1)
    return st["drafter"]


def drafter_steps(llm) -> int:
    """Proposals the drafter actor that rank 0 started last has served."""
    def steps(self):
        import ray as _ray

        return _ray.get(self.loop.faults.restart.handle.__ray_call__.remote(lambda d: d.num_steps))

    return ray.get(llm._core.driver.__ray_call__.remote(steps))


def check_speculation_resumed(llm, ref):
    """Later requests draft again (acceptance above 1: while the drafter is
    down blocks are one row, without prompt lookups either), exactly as a
    run that never lost one."""
    later = llm.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in later] == [o.token_ids for o in ref["short"]]
    assert [o.metrics.acceptance_lengths for o in later] == [o.metrics.acceptance_lengths for o in ref["short"]]
    assert sum(o.metrics.num_draft_tokens for o in later) > 0
    steps = [a for o in later for a in o.metrics.acceptance_lengths]
    assert sum(steps) / len(steps) > 1.0


@pytest.mark.parametrize("fault", ["kill", "hang", "raise", "kill-async"])
def test_separate_drafter_lost_mid_generate(cluster, fault):
    """The drafter actor's process SIGKILLed, stuck in propose (the channel
    times out), or raising: generate finishes with the tokens of a run
    without the fault; a new drafter actor is started, re-seeded with the
    context of the requests still running, and drafts again. "kill-async":
    the kill lands in a chain of async step graphs (the GPU default), whose
    exchange with the drafter fails inside rank 0's step."""
    root = cluster
    # whole blocks every step (no policy): acceptance is compared step by step with a run without the fault
    steps = dict(cuda_graphs=True, async_scheduling=True, adaptive_speculation=False) if fault.endswith("async") \
        else {}
    llm = LLM(root / "t", root / "d", backend="ray", drafter_placement="separate", **KW, **steps)
    try:
        ref = reference(llm)
        assert bool(steps) == (llm.stats()["num_async_steps"] > 0)
        pace_while_drafter_down(llm)
        drafter = llm._core.actors.drafter

        def fault_now():
            if fault.startswith("kill"):
                os.kill(pid_of(drafter), signal.SIGKILL)
                return

            def patch(self):
                import time as _time

                def bad(*a, **k):
                    if fault == "hang":
                        _time.sleep(3600)
                    raise RuntimeError("injected drafter failure")

                self.worker.propose = bad

            ray.get(drafter.__ray_call__.remote(patch))

        steps = llm.stats()["num_steps"]
        th, box = when_stepping(llm, fault_now, steps + 4)
        got = llm.generate(PROMPTS, LONG)
        th.join()
        assert [o.token_ids for o in got] == [o.token_ids for o in ref["long"]]
        state = wait_drafter_up(llm)
        assert state["losses"] == 1 and state["restarts"] == 1
        assert state["reseeded"] > 0, "the new drafter came up after every request had finished"
        assert actor_table()[drafter._actor_id.hex()]["State"] == "DEAD"
        before = drafter_steps(llm)
        check_speculation_resumed(llm, ref)
        assert drafter_steps(llm) > before  # the new drafter actor proposed
    finally:
        llm.shutdown()


def test_separate_drafter_lost_while_the_policy_takes_turns(cluster):
    """The kill lands in a chain whose steps take turns (forced) between whole
    blocks, a shorter chain and autoregressive steps, each of which the
    drafter replays its own way: generate still finishes with the run's
    tokens, and a new drafter drafts again."""
    root = cluster
    llm = LLM(root / "t", root / "d", backend="ray", drafter_placement="separate", cuda_graphs=True,
              async_scheduling=True, extra={"policy_turns": [7, 3, 0]}, **KW)
    try:
        ref = reference(llm, ["long", "short"])
        pace_while_drafter_down(llm)
        check_drafter_killed_mid_generate(llm, ref)
    finally:
        llm.shutdown()


def check_drafter_killed_mid_generate(llm, ref):
    """SIGKILL the separate drafter a few steps into a generate: it still
    finishes with the run's tokens, one loss and one restart are counted,
    and the new drafter drafts later requests."""
    drafter, killed = llm._core.actors.drafter, []

    def kill():
        os.kill(pid_of(drafter), signal.SIGKILL)  # raises if it was gone already (lost some other way)
        killed.append(True)

    th, _ = when_stepping(llm, kill, llm.stats()["num_steps"] + 4)
    got = llm.generate(PROMPTS, LONG)
    th.join()
    assert killed
    assert [o.token_ids for o in got] == [o.token_ids for o in ref["long"]]
    state = wait_drafter_up(llm)
    assert state["losses"] == 1 and state["restarts"] == 1
    later = llm.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in later] == [o.token_ids for o in ref["short"]]
    assert sum(o.metrics.num_draft_tokens for o in later) > 0


def test_colocated_drafter_that_raises(cluster):
    root = cluster
    llm = LLM(root / "t", root / "d", backend="ray", drafter_placement="colocated", **KW)
    try:
        ref = reference(llm, ["short"])
        def patch(self):
            first, calls = self._drafter, []
            orig = first.propose

            def propose(batch):
                calls.append(1)
                if len(calls) == 5:
                    raise RuntimeError("injected drafter failure")
                return orig(batch)

            first.propose = propose

        ray.get(llm._core.driver.__ray_call__.remote(patch))
        got = llm.generate(PROMPTS, SHORT)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref["short"]]
        state = llm.stats()["drafter"]
        assert (state["state"], state["restarts"]) == ("up", 1) and "injected drafter failure" in state["error"]
        check_speculation_resumed(llm, ref)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("victim", [0, 1, "1-async"])
def test_target_rank_killed_mid_generate(cluster, victim):
    """A target rank's process SIGKILLed (rank 0, or a follower of a TP 2
    group, also while it replays async step graphs): the generate call
    fails with EngineUnavailable within 5 s, the group is rebuilt (new
    actors, new placement group), the next call is served, and no actor of
    the old group is left alive."""
    root = cluster
    steps = dict(cuda_graphs=True, async_scheduling=True) if victim == "1-async" else {}
    victim = int(str(victim)[0])
    llm = LLM(root / "t", root / "d", backend="ray", tensor_parallel_size=2, drafter_placement="separate", **KW,
              **steps)
    try:
        ref = reference(llm, ["short"])
        assert bool(steps) == (llm.stats()["num_async_steps"] > 0)
        old = llm._core.actors
        old_ids = [a._actor_id.hex() for a in old.ranks + [old.drafter]]
        old_pg = old.placement_group.id.hex()
        th, box = when_stepping(llm, lambda: os.kill(pid_of(old.ranks[victim]), signal.SIGKILL),
                                llm.stats()["num_steps"] + 4)
        with pytest.raises(EngineUnavailable):
            llm.generate(PROMPTS, LONG)
        failed_after = time.monotonic() - box["t"]
        assert failed_after < 5.0, failed_after
        t = time.monotonic()
        got = llm.generate(PROMPTS, SHORT)  # waits for the rebuild
        assert [o.token_ids for o in got] == [o.token_ids for o in ref["short"]]
        assert time.monotonic() - t < 60 and llm._core.group.rebuilds == 1
        table = actor_table()
        assert [table[i]["State"] for i in old_ids] == ["DEAD"] * 3
        new = llm._core.actors
        new_ids = {a._actor_id.hex() for a in new.ranks + [new.drafter]}
        alive = {k for k, v in table.items() if v["State"] == "ALIVE" and v["ActorClassName"] in
                 ("TargetRank", "DrafterActor")}
        assert alive == new_ids
        assert ray.util.placement_group_table()[old_pg]["state"] == "REMOVED"
        stats = llm.stats()
        assert all(free == cap for free, cap in stats["pools"].values())
    finally:
        llm.shutdown()


def test_a_request_that_breaks_the_step_fails_alone_through_ray(cluster):
    root = cluster
    llm = LLM(root / "t", root / "d", backend="ray", drafter_placement="separate",
              extra={"fault_injection": {"seed": 666, "where": "step"}}, **KW)
    try:
        ref = reference(llm, ["short"])
        params = [SHORT] * len(PROMPTS)
        params[5] = dataclasses.replace(SHORT, seed=666)
        got = llm.generate(PROMPTS, params, errors="return")
        assert [o.finish_reason for o in got] == ["length"] * 5 + ["error", "length", "length"]
        assert got[5].error_kind == "request" and "injected step failure" in got[5].error
        assert [o.token_ids for i, o in enumerate(got) if i != 5] == \
            [o.token_ids for i, o in enumerate(ref["short"]) if i != 5]
        stats = llm.stats()
        assert stats["num_unfinished"] == 0 and all(free == cap for free, cap in stats["pools"].values())
        with pytest.raises(RuntimeError, match="injected step failure"):
            llm.generate([PROMPTS[0], PROMPTS[1]], [SHORT, params[5]])
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_gpu_drafter_beside_rank_0_killed_mid_generate(tmp_path):
    """One GPU, the drafter its own actor beside rank 0 (``separate_same_gpu``,
    tensors through the CUDA IPC ring) and SIGKILLed while rank 0's step
    graphs wait on it: rank 0's wait is aborted past ``drafter_timeout_s``,
    generate finishes with the run's tokens, and a new drafter pairs (a new
    ring) and drafts again. The policy's kinds are forced in turns: left to
    measure, it runs a random drafter's requests autoregressively but for
    its probes, which a short generate may miss (H100: in two runs of five
    the requests after the restart drafted nothing)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = make_models(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    llm = LLM(root / "t", root / "d", backend="ray", device="cuda", dtype="float32",
              drafter_placement="separate_same_gpu", cuda_graphs=True, async_scheduling=True,
              num_kv_blocks=512, drafter_timeout_s=3.0, extra={"policy_turns": [7, 3, 0]})
    try:
        check_drafter_killed_mid_generate(llm, reference(llm, ["long", "short"]))
    finally:
        llm.shutdown()

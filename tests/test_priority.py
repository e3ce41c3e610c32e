"""The engine's processes put their threads back at niceness 0 (Ray starts
its workers at 15): priority.normal_priority, in a child process."""

import multiprocessing as mp
import os
import threading

import pytest

from specray.priority import local_ray_env, normal_priority


def _child(q):
    os.nice(10)  # as Ray's raylet leaves a worker (at 15)
    started = threading.Event()
    stop = threading.Event()
    t = threading.Thread(target=lambda: (started.set(), stop.wait()))
    t.start()
    started.wait()
    try:
        os.setpriority(os.PRIO_PROCESS, t.native_id, 10)
    except PermissionError:
        pass
    before = {tid: os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 9)  # lowering needs the privilege normal_priority needs
        os.setpriority(os.PRIO_PROCESS, 0, 10)
        allowed = True
    except PermissionError:
        allowed = False
    normal_priority()
    after = {tid: os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
    stop.set()
    t.join()
    q.put((allowed, before, after))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux threads")
def test_every_thread_goes_back_to_niceness_0():
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_child, args=(q,))
    p.start()
    allowed, before, after = q.get(timeout=30)
    p.join(10)
    assert sum(v == 10 for v in before.values()) >= 2, before  # the main thread and one it started
    if not allowed:
        pytest.skip("this user may not lower a niceness (normal_priority then warns and leaves it)")
    assert set(after.values()) == {0}, after


def test_a_local_ray_starts_its_workers_at_niceness_0(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    local_ray_env()
    assert os.environ["RAY_worker_niceness"] == "0"
    monkeypatch.setenv("RAY_worker_niceness", "5")  # the user's choice stands
    local_ray_env()
    assert os.environ["RAY_worker_niceness"] == "5"

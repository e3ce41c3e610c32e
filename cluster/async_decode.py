"""Asynchronous decode steps: step n+1 is launched from step n's results on
the device, before the host has read them.

A synchronous step leaves the GPU idle while the host builds the next
batch, launches it and, after the one sync, applies the tokens (detokenize,
stop checks, bookkeeping). For a decode-only batch nothing in step n+1's
inputs needs the host: each row's block starts at
``start + num_accepted + 1`` and opens with the bonus token, and the
positions, slots (from block tables reserved two blocks ahead) and
sequence lengths follow on the device. So the engine enqueues step n+1
(one graph replay: propose, verify, accept, context store;
actors/step_graph.py) and only then waits for step n's results, which it
applies while the GPU runs step n+1. Requests enter chains at the
prefill that finishes their prompts, or join a running one
(chain_admit.py).

Tokens do not change: every row emits exactly what the synchronous step
would. Its drafts are the same (prompt lookups run over a copy of the
row's tokens on the device, which the graph extends as it accepts them),
sampled rows draw the same counter-based uniforms (hashed on the device
from the device's positions), and a row near its max_tokens verifies the
same cut-short block (its emit budget lives on the device). A row whose
request finishes while its next step is in flight has that step's results
dropped, and the row rides as padding until a joining request takes its
place. The engine drains back to synchronous steps where the rows must
change otherwise (``_can_chain``).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from specray.actors.kv_cache import block_table_tensor
from specray.faults import drafter_part, fail_request, format_error
from specray.request import Request, RequestOutput
from specray.chain_admit import may_join
from specray.chain_rows import HISTORY_UPLOADS, batch_mode, first_inputs, join_rows, write_history
from specray.drafter_rest import TRIAL_STEPS, refill_context


@dataclass
class InflightStep:
    """A launched decode step whose results the host has not read."""

    requests: list[Request]
    results: torch.Tensor  # [S, B + 2] int64 on the host: accepted, bonus, drafted by lookup, drafts
    ready: torch.cuda.Event | None  # recorded after the copy into ``results``
    lane: int = 0  # the micro-batch it belongs to (its graphs, state and stream)
    timing: tuple | float | None = None  # CUDA events around the replay, or its host seconds off CUDA
    # drafts a row verified at most: the drafter's block's, a shorter chain's, or 0 (an
    # autoregressive step: spec_policy.py; every step of an engine without a drafter)
    drafts: int = 0
    padded: int = 0  # the batch size its graph ran at
    mode: str = "greedy"
    accepted: list[tuple[int, int]] | None = None  # a speculative step's, once applied: per live row (accepted, verified)
    captured: bool = False  # its launch captured its graph (its wait may include the drafter's capture)
    context: bool = True  # False: a resting drafter's step, no context stored (drafter_rest.py)
    rested: bool = False  # a speculative step of a resting drafter's (a probe): its acceptance is not the drafter's

    def gpu_seconds(self) -> float:
        if isinstance(self.timing, tuple):
            return self.timing[0].elapsed_time(self.timing[1]) / 1000
        return self.timing or 0.0

    def wait(self, wait=None) -> None:
        """Until the results are on the host; ``wait(event)`` in place of a
        plain sync (``step_wait.result_wait``)."""
        if self.ready is not None:
            self.ready.synchronize() if wait is None else wait(self.ready)

    def read(self) -> list[tuple[int, int, bool, list[int]]]:
        """Per row: (num_accepted, bonus, drafted by lookup, drafts)."""
        self.wait()
        return [(r[0], r[1], bool(r[2]), r[3:]) for r in self.results.tolist()]


def launch_decode(core, requests: list[Request], chained: bool,
                  first_tokens: torch.Tensor | None = None, lane: int = 0, drafts: int | None = None,
                  joined: tuple[int, ...] = ()) -> InflightStep:
    """Enqueue one step graph replay (actors/step_graph.py) for
    ``requests``: a first step loads each row's start and last token from
    the host (or, with ``first_tokens`` ``[S]`` on the device, opens each
    row's block with that token, the one after its prompt), a chained one
    continues from the previous replay's. Blocks must be reserved through
    each row's block (``start + B``, or its cut-short end: the rows past
    that end write K/V nothing reads, into the row's last block or the
    reserved block 0). ``lane``: the micro-batch, whose graphs replay on
    its own CUDA stream (``EngineCore.lane_stream``). ``drafts``: how many
    drafts a row verifies (``EngineCore.speculate``; None: the drafter's
    whole block); 0 is an autoregressive step (one row a request; the
    drafter stores its context), fewer than the block a shorter chain.
    ``joined``: the rows of a chained step whose requests join the chain
    here, their first tokens ``first_tokens`` on the device (chain_admit.py)."""
    with core.lane_stream(lane):
        return _launch(core, requests, chained, first_tokens, lane, drafts, joined)


def _launch(core, requests, chained, first_tokens, lane, drafts, joined=()) -> InflightStep:
    mode = batch_mode(requests, core.target_spec.vocab_size)
    full = core.block_size - 1
    drafts = full if drafts is None else drafts
    spec, block = drafts > 0 or full == 0, (drafts + 1 if 0 < drafts < full else None)
    context = spec or not core.rest.resting
    new_kind = not core.has_step_graphs(mode, lane, spec, block, context)
    graphs = core.step_graphs(mode, lane, spec, block, context)
    dev = core.device
    inputs, uploads = {}, None
    if not chained:
        inputs, uploads = first_inputs(core, requests, first_tokens, mode, graphs)
        if first_tokens is not None:  # a drafter in another process takes them over its data channel
            inputs["after_prefill"] = torch.ones(1, dtype=torch.bool)
    else:
        if joined:  # their rows' state is written in place; the others' stays the device's
            apart = getattr(core.drafter, "step_link", None) is not None
            inputs.update(join_rows(core, graphs, requests, joined, first_tokens, mode, apart))
        if joined or any(r.finished for r in requests):
            # Finished rows ride as padding (EngineCore._can_chain): freed, their
            # tables are empty (block 0), and ``real`` off restarts them at 0.
            inputs["real"] = torch.tensor([not r.finished for r in requests], dtype=torch.bool)
    # Tables change only when a row crosses into a new block: upload them then.
    tables = [r.target_blocks.blocks for r in requests]
    if not chained or tables != core.uploaded_tables[lane]:
        inputs["target_tables"] = block_table_tensor(tables)
        if core.drafter is not None:
            inputs["draft_tables"] = block_table_tensor([r.draft_blocks.blocks for r in requests])
        core.uploaded_tables[lane] = [list(t) for t in tables]
    if uploads is not None and "history" not in graphs.buffers:  # the drafter's process keeps the history
        inputs.update(zip(HISTORY_UPLOADS, uploads))
        uploads = None
    core.announce_step(len(requests), mode, chained, inputs, spec, lane, block)
    inputs = {k: v for k, v in inputs.items() if k in graphs.buffers}
    if uploads is not None:
        write_history(graphs, inputs, uploads, first_tokens)
    timed = core.config.profile_steps or core.policy is not None
    timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
        if timed and dev.type == "cuda" else None
    if timing:
        timing[0].record()
    # A first replay at this size also captures its graph: not a step's time.
    fresh = graphs.use_graphs and (new_kind or graphs.padded(len(requests)) not in graphs.graphs)
    t = time.perf_counter()
    (out,) = graphs.run(len(requests), inputs)
    if timing:
        timing[1].record()
    elif timed:  # off CUDA the replay runs as it is called
        timing = time.perf_counter() - t
    if fresh:
        timing = None
    out = out[: len(requests)]
    if dev.type == "cuda":
        results, ready = core.result_buffers.fetch(out)
    else:
        results, ready = out.clone(), None
    return InflightStep(list(requests), results, ready, lane, timing, drafts, graphs.padded(len(requests)),
                        mode, captured=fresh, context=context, rested=spec and core.rest.resting)


def _graphs_key(sampling: str, lane: int, spec: bool, block: int | None = None, context: bool = True) -> tuple:
    if not spec:
        return (sampling, lane, "ar") if context else (sampling, lane, "ar", "rest")
    return (sampling, lane, block) if block else (sampling, lane)


class AsyncSteps:
    """``EngineCore``'s side of asynchronous steps: when a step may run as a
    step graph, rank 0's graphs, the word to the other processes, chaining
    and applying."""

    def _async_unsupported(self) -> str | None:
        if not self.config.async_scheduling:
            return "turned off (async_scheduling=False)" if self.config.cuda_graphs else "needs CUDA graphs"
        if self.config.sync_timing:
            return "sync_timing measures synchronous steps"
        workers = [self.target] + ([self.drafter] if self.drafter is not None else [])
        for w in workers:
            if not getattr(w, "runs_step_graphs", False):
                return getattr(w, "step_graphs_unsupported", None) or "needs step graphs on every worker"
        if self.device.type == "cuda" and self.drafter_apart():
            remote = self.config.remote_step_graphs
            if remote is False:
                return "turned off for a drafter in another process (remote_step_graphs=False)"
            if remote is None and not getattr(self.drafter, "on_rank0_gpu", False):
                return "the drafter is on another GPU, where its half of the step graphs has not run yet " \
                       "(remote_step_graphs=True runs it)"
        return None

    def drafter_apart(self) -> bool:
        """A drafter in another process (it replays its half of the step graphs)."""
        return self.drafter is not None and not getattr(self.drafter, "local_model", False)

    def _async_eligible(self, plan) -> bool:
        """A decode-only step, with the target (TP 1) and the drafter in
        this process, may start a chain of asynchronous steps (a row's
        cut-short block is cut on the device, by its emit budget)."""
        if plan.prefill or plan.preempted or not plan.decode:
            return False
        return self.async_capable([d.request for d in plan.decode])

    def async_capable(self, requests: list[Request]) -> bool:
        """Whether these requests' decode steps may run as step graphs
        launched ahead of the host (the settings and the workers allow it)."""
        if self._async_unsupported() is not None:
            return False
        if any(r.reads_verify_rows for r in requests):
            return False
        # A sampled row's lookup draft needs its one-hot q: synchronous steps have it.
        return not (self.config.prompt_lookup_min and self.config.prompt_lookup_sampled and
                    not all(r.params.greedy for r in requests))

    def step_graphs(self, sampling: str, lane: int = 0, spec: bool = True, block: int | None = None,
                    context: bool = True):
        """Rank 0's whole-step graphs, for batches whose ``sampling`` is
        "greedy", "sampled" or "filtered" (a drafter or TP followers in other
        processes replay their halves: actors/step_peers.py), of micro-batch
        ``lane``: each lane has its state, its graphs and their memory; the
        token history is one (its rows are the requests'). ``spec=False``:
        the autoregressive steps of a speculative engine (``context=False``:
        its resting drafter's, drafter_rest.py); ``block``: a shorter
        chain's rows a request (``shorter_drafts``)."""
        key = _graphs_key(sampling, lane, spec, block, context)
        if key not in self._step_graphs:
            from specray.actors.step_graph import build_step_graphs
            from specray.actors.step_parts import StepSettings

            target = getattr(self.target, "worker", self.target)
            local = None if self.drafter_apart() else self.drafter
            settings = StepSettings.make(self.config, self.block_size, self.max_model_len,
                                         self.drafter_spec.mask_token_id if self.drafter_spec else None)
            shared = self._step_buffers.setdefault(lane, {})
            if lane and "history" in self._step_buffers[0]:
                shared.setdefault("history", self._step_buffers[0]["history"])
            self._step_graphs[key] = build_step_graphs(
                target, local, settings, sampling=sampling, shared=shared,
                tree=None if block else self.tree,
                remote=getattr(self.drafter, "step_link", None), tp=getattr(self.target, "tp_link", None),
                speculate=spec, block_size=block, family=("step", lane), context=context,
            )
            if self.config.capture_all_batch_sizes and not self._peers():
                self._step_graphs[key].capture_all()
        return self._step_graphs[key]

    def has_step_graphs(self, sampling: str, lane: int = 0, spec: bool = True, block: int | None = None,
                        context: bool = True) -> bool:
        return _graphs_key(sampling, lane, spec, block, context) in self._step_graphs

    # ------------------------------------------------- micro-batch lanes
    def _overlap_unsupported(self) -> str | None:
        if self.config.overlap is False:
            return "turned off (overlap=False)"
        if self._async_unsupported() is not None:
            return "needs async_scheduling"
        if self.config.overlap is None:
            # Under closed-loop load on the H200 (requests joining and
            # leaving every few steps) an in-process engine with lanes
            # stopped stepping; they stay opt-in until that is found.
            return "off by default (a GPU hang under request churn is open; overlap=True turns lanes on)"
        if self.device.type == "cuda" and self._peers():
            # Each lane's exchanges would need NCCL communicators of its own
            # (two streams issuing on one communicator can deadlock).
            return "not built on GPUs for a drafter or TP followers in other processes"
        return None

    def lane_split(self, requests: list[Request]) -> list[list[Request]]:
        """The micro-batches a chain of asynchronous steps runs as: two lanes,
        each on a CUDA stream of its own, whose steps the GPU overlaps (one
        lane's drafter kernels under the other's target kernels), where the
        batch is at least ``overlap_min_batch``; else one."""
        if len(requests) < self.config.overlap_min_batch or self._overlap_unsupported() is not None:
            return [requests]
        half = (len(requests) + 1) // 2
        return [requests[:half], requests[half:]]

    def lane_stream(self, lane: int):
        """A context that makes lane ``lane``'s stream current (lane 0: the
        engine's own; lane 1 a side stream that first waits for it)."""
        import contextlib

        if lane == 0 or self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self._side_stream)

    def _start_lanes(self, parts: list[list[Request]]) -> list[InflightStep]:
        self.begin_chain()
        if len(parts) > 1 and self.device.type == "cuda":
            self.lane_stream(1)  # created on first use
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        drafts = self.speculate(parts[0])
        return [launch_decode(self, part, chained=False, lane=i, drafts=drafts) for i, part in enumerate(parts)]

    def speculate(self, requests: list[Request]) -> int | None:
        """How many drafts each row of the next step of these rows verifies
        (spec_policy.py): 0 (an autoregressive step), a shorter chain's, or
        None (the drafter's whole block)."""
        if self.policy is None:
            return None
        from specray.actors.graphs import padded_size

        padded = padded_size(len(requests), self.config.max_num_seqs)
        kind = "greedy" if all(r.params.greedy for r in requests) else "sampled"
        if self.rest.resting:
            self.policy.resting(kind, len(requests))
        drafts = self.policy.choose(padded, kind)
        return self.rest.steer(drafts, self.policy.exploring)

    def _wake_drafter(self) -> None:
        """Before the step after a drained chain: what a resting drafter
        skipped, every running request's (drafter_rest.py)."""
        target = getattr(self.target, "worker", self.target)
        self.rest.refilled_tokens += refill_context(target, self.drafter, self.scheduler.running)
        if self.rest.woke():
            self.policy.hold(self.block_size - 1, TRIAL_STEPS)

    def _observe_cycle(self, now: float) -> None:
        """What the policy learns from the last ``step()`` call, when the
        chain went on: the steps it applied cost the longer of their GPU time
        and the cycle's wall time (launch, apply, and what the serving
        threads did meanwhile). With small models the host is the limit,
        and its cost grows with the tokens a step emits. A cycle is timed
        only in a steady run of one kind and batch size: not where its step
        follows one of another kind or opens a chain (it carries the other
        step's work), nor where it launched a step of another kind (its
        launch is the other kind's); its tokens still count."""
        cycle, self._cycle = self._cycle, None
        if self.policy is None or cycle is None or not self._inflight:
            self._observed_kind = None
            return
        start, steps = cycle
        if any(p.timing is None for p in steps):  # a graph captured in it
            self._observed_kind = None
            return
        p, launched = steps[0], self._inflight[0]  # what the cycle applied, what it launched
        kind, last = (p.padded, p.drafts, p.mode), self._observed_kind
        self._observed_kind = kind
        rows = [row for q in steps for row in q.accepted or ()]
        steady = kind == last == (launched.padded, launched.drafts, launched.mode)
        seconds = max(sum(q.gpu_seconds() for q in steps), now - start) if steady else 0.0
        self.policy.observe(p.padded, p.drafts, seconds, p.mode, rows)

    def _adaptive_unsupported(self) -> str | None:
        if self.drafter is None:
            return "no drafter"
        if self.config.adaptive_speculation is False:
            return "turned off (adaptive_speculation=False)"
        if self._async_unsupported() is not None:
            return "needs async_scheduling"
        return None

    def _rest_unsupported(self) -> str | None:
        if self.policy is None:
            return "needs adaptive_speculation"
        if not self.config.drafter_rest:
            return "turned off (drafter_rest=False)"
        if self.drafter_apart() or getattr(self.target, "tp_link", None) is not None:
            return "a drafter in this process and a target at TP 1 only"
        return None

    def _shorter_drafts(self) -> tuple[int, ...]:
        """Draft counts of the shorter chains the policy may verify: the
        block halved while it keeps ``shortest_verify_block`` rows. Chains
        (where the whole block holds a draft tree, the shorter ones are
        chains); TP followers replay each length's verify shard, a drafter
        in another process its proposal at that length."""
        out, rows = [], self.block_size // 2
        while rows >= max(2, self.config.shortest_verify_block):
            out.append(rows - 1)
            rows //= 2
        return tuple(out)

    def _join_lanes(self) -> None:
        """What the side lane wrote (K/V, context) comes before anything the
        engine's stream does next."""
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)

    def announce_step(self, n: int, mode: str, chained: bool, inputs: dict, spec: bool = True,
                      lane: int = 0, block: int | None = None) -> None:
        """The host message that has the drafter and the TP followers in
        other processes replay their halves of the step about to launch
        (``block``: a shorter chain's rows a request, a chain)."""
        from specray.actors.step_peers import CHAINED, FIRST, StepWord

        word = StepWord(n, mode, self.tree is not None and spec and not block, CHAINED if chained else FIRST,
                        spec, lane, block or 0)
        for w in self._peers():
            with drafter_part("the step's word") if w is self.drafter else nullcontext():
                w.async_step(word, inputs)

    def _peers(self) -> list:
        """The workers in other processes that replay halves of step graphs;
        the drafter first, so that a lost one fails a step before the TP
        followers are told to replay it. Rank 0's driver of a TP group of
        one has no followers and is no peer: the Ray backend at TP 1 with
        its drafter colocated runs the in-process engine's features
        (shorter chains, joins)."""
        return [w for w in (self.drafter, self.target) if hasattr(w, "async_step") and getattr(w, "followers", True)]

    def forget_step_graph_state(self) -> None:
        """The step graphs were dropped (a lost drafter): what the host knew
        of their buffers goes with them."""
        self.history_slots.clear()
        self.uploaded_tables = [[], []]

    def begin_chain(self) -> None:
        self._observed_kind = None  # a chain's first cycle waits for its first step whole: not timed
        self.join_wait.reset()
        for w in self._peers():
            if hasattr(w, "begin_chain"):
                with drafter_part("a chain's start") if w is self.drafter else nullcontext():
                    w.begin_chain()

    def _can_chain(self, requests: list[Request]) -> bool:
        """Whether the steps after those in flight for ``requests`` may be
        launched before their results are applied: the rows still running
        (finished ones ride along as padding while ``_finished_rows_ride``
        allows), none near a length limit, no waiting request that
        scheduling would admit now unless it may join the chain
        (``_join_next``: chain_admit.py; one that does not fit waits for a
        finish, which drains), and room to reserve every row's blocks two
        verify blocks ahead."""
        sched, B = self.scheduler, self.block_size
        self._join_next = 0
        if self.rest.waking:
            return self._drain("the drafter wakes")
        live = [r for r in requests if not r.finished]
        if not live or len(sched.running) != len(live):
            return self._drain("rows changed")
        joins = may_join(self, requests) if self._rows_may_finish() else 0
        waits = self.join_wait.waits(joins, len(requests))
        if not joins and sched.could_admit(len(live) * B):
            return self._drain("admission")
        if len(live) < len(requests) and not self._finished_rows_ride(len(requests), len(live), joins):
            return self._drain("a row finished")
        # ``prev`` emits at least one token, the last: without padding rows a
        # row with one token left would run a step past its end.
        last_token_ends = not self._rows_may_finish()
        for r in live:
            # The host's view lags ``prev``: it may advance by up to B, and
            # its next block needs B rows more.
            if r.num_computed + 2 * B > self.max_model_len:
                return self._drain("length limit")
            if last_token_ends and r.params.max_tokens - len(r.output_token_ids) <= 1:
                return self._drain("max_tokens next")
        if not all(sched.reserve(r, r.num_computed + 2 * B) for r in live):
            return self._drain("no room to reserve")
        self._join_next = 0 if waits else joins
        return True

    def _rows_may_finish(self) -> bool:
        """Whether a chain may run on past finished rows and admit requests
        into finished rows' places: one lane (a separate drafter is sent
        the joined rows' state, chain_rows.join_rows; TP followers keep
        none)."""
        return self._join_unsupported() is None and len(self._inflight) <= 1

    def _finished_rows_ride(self, rows: int, live: int, joins: int) -> bool:
        """Whether the chain goes on with ``rows - live`` finished rows as
        padding: while a waiting request may join it (into a finished row's
        place), else until the live rows would fit a smaller graph."""
        from specray.actors.graphs import padded_size

        if not self._rows_may_finish():
            return False
        return joins > 0 or padded_size(live, self.config.max_num_seqs) == padded_size(rows, self.config.max_num_seqs)

    def _drain(self, why: str) -> bool:
        """Ends the chain; ``chain_breaks`` counts why (bench/load_profile.py)."""
        self.chain_breaks[why] += 1
        return False

    def _apply_inflight(self, step: InflightStep, chained: bool) -> list[RequestOutput]:
        """Apply an asynchronous step's tokens. With the next step in flight
        its blocks stay reserved; rows of requests that finished meanwhile
        are dropped."""
        outputs = []
        rows = step.read()
        # The block the graph verified, cut as the scheduler cuts it from
        # the host's view when the step was launched (it is now).
        verified = [min(self.scheduler.block_len(r) - 1, step.drafts) for r in step.requests]
        if step.drafts and not step.rested:
            step.accepted = [(row[0], g) for r, row, g in zip(step.requests, rows, verified) if not r.finished]
        for r, (a, bonus, looked_up, drafts), num_drafts in zip(step.requests, rows, verified):
            if r.finished:
                continue
            r.metrics.num_lookup_steps += looked_up
            if not step.context and r.context_gap_from is None:
                r.context_gap_from = r.num_computed
            try:
                # Chained, the room _can_chain reserves (two blocks ahead) stays:
                # trimmed back to one, a row freed a block and took one again
                # nearly every step, and its changed tables went up again.
                outputs.append(self._emit(r, drafts, a, bonus, num_drafts, 2 * self.block_size if chained else 0))
            except Exception as e:  # its own host code: it fails alone (faults.py)
                outputs.append(fail_request(self, r, format_error(e)))
        return self._forget_finished(outputs)

"""EngineCore: the speculative step loop.

One step:
  1. plan: decode blocks for running requests, prefill chunks for new ones;
  2. propose: one batched drafter forward for every decoding request;
  3. verify: one target forward over all verify blocks and prefill chunks;
  4. accept: greedy or rejection sampling, one host sync for the results;
  5. feedback: tapped hidden states of accepted rows enter the drafter's
     context KV; rejected target KV is rolled back; finished requests free
     their blocks.

The core talks to a target and a drafter through four calls
(``target.execute``, ``target.hidden_rows``, ``drafter.propose``,
``drafter.store_context``): in-process workers here, the rank-0 side of a
Ray actor group in the distributed backend.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from specray.actors.kv_cache import BlockAllocator
from specray.async_decode import AsyncSteps, InflightStep, launch_decode
from specray import chain_admit
from specray.chain_admit import chain_from_prefill, join_chain
from specray.config import ConfigError, DrafterSpec, EngineConfig, TargetSpec
from specray.detokenizer import decodes_in_runs, max_prompt_chars, text_decoder
from specray.draft_tree import load_universe, unsupported as tree_unsupported
from specray.faults import fail_request, format_error
from specray.emit import RequestEmit
from specray.intake import RequestIntake
from specray.join_wait import JoinWait
from specray.request import Request, RequestOutput
from specray.prompt_lookup import merge_lookup_drafts
from specray.sampling import SamplingParams, SamplingTensors
from specray.staging import host_to_device, int64_tensor
from specray.step_buffers import HistorySlots, ResultBuffers
from specray.scheduler import Scheduler
from specray.drafter_rest import DrafterRest
from specray.spec_policy import SpecPolicy, scripted, step_key
from specray.step_wait import result_wait
from specray.step_batch import StepBatches
from specray.step_rows import VerifyRows
from specray.sync_accept import SyncAccept


@dataclass
class StepStats:
    """Wall time of the last step and of its model passes (seconds)."""

    num_decode: int = 0
    num_prefill_tokens: int = 0
    total: float = 0.0
    propose: float = 0.0
    verify: float = 0.0


class EngineCore(RequestIntake, StepBatches, VerifyRows, SyncAccept, AsyncSteps, RequestEmit):
    # Tests turn on prompts prefilled one a step (``lone_prefills``) on the
    # CPU's padded graph path, where it only adds compute otherwise.
    lone_prefills_off_cuda = False

    def __init__(
        self,
        config: EngineConfig,
        target_spec: TargetSpec,
        drafter_spec: DrafterSpec | None,
        target,
        drafter,
        tokenizer,
        max_model_len: int,
        num_target_blocks: int,
        num_draft_blocks: int | None,
    ):
        self.config = config
        self.target_spec = target_spec
        self.drafter_spec = drafter_spec
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.block_size = config.draft_block_size(drafter_spec.block_size) if drafter_spec else 1
        self.device = target.device
        kv_bs = config.kv_block_size
        target_pool = BlockAllocator(num_target_blocks, kv_bs, "target KV")
        draft_pool = BlockAllocator(num_draft_blocks, kv_bs, "drafter context KV") if drafter else None
        for pool in filter(None, (target_pool, draft_pool)):
            if pool.capacity * kv_bs < max_model_len:
                raise ConfigError(
                    f"{pool.name} holds {pool.capacity * kv_bs} positions, fewer than max_model_len "
                    f"{max_model_len}: lower max_model_len or give the cache more memory"
                )
        self.scheduler = Scheduler(
            target_pool,
            draft_pool,
            self.block_size,
            max_model_len,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        # Fast tokenizers are not safe to share between threads. Callers
        # tokenize prompts with an instance of their own, the step thread
        # detokenizes with ``tokenizer``: under one lock, a long prompt's
        # tokenization held every stream's detokenization (the GIL is
        # released while it runs).
        self.tokenizer_lock = threading.Lock()
        self._decode = text_decoder(tokenizer)
        self._decode_runs = decodes_in_runs(tokenizer)
        self._encoder = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self._encoder_lock = threading.Lock()
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len - 1)
        self.last_step = StepStats()
        self._inflight: list[InflightStep] = []  # asynchronous steps not yet applied, one a lane
        self._step_graphs = {}
        self._step_buffers: dict[int, dict[str, torch.Tensor]] = {}  # a lane's inputs its sampling kinds share
        self._side_stream = None  # the second lane's
        self.history_slots = HistorySlots(self.config.max_num_seqs)  # requests' rows of the graphs' token history
        self.result_buffers = ResultBuffers()  # pinned copies of steps' results
        self.uploaded_tables: list[list[list[int]]] = [[], []]  # what each lane's graphs' block tables hold
        self.num_async_steps = 0
        # Wall time of the async steps, and (profile_steps) their replays' GPU time.
        self.async_wall_s = self.async_gpu_s = 0.0
        self.num_prefill_chains = 0  # chains whose first step was launched from a prefill's device tokens
        self.tree = self._tree_universe()
        self.policy = SpecPolicy(self.block_size, self._shorter_drafts(), tree=self.tree is not None) \
            if self._adaptive_unsupported() is None else None
        self.rest = DrafterRest(supported=self._rest_unsupported() is None)
        if self.policy is not None and (config.extra or {}).get("policy_turns"):
            self.policy.choose = scripted(self.policy, config.extra["policy_turns"])
        self._cycle: tuple | None = None  # (start, the steps applied in it) of the last async step() call
        self._join_next = 0  # requests at the head of the queue _can_chain found may join the running chain
        self.join_wait = JoinWait(chain_admit.JOIN_MAX, config.join_wait_steps, config.join_batch)  # when they join
        self.num_chain_joins = 0  # requests admitted into a running chain (chain_admit.py)
        self.chain_breaks: Counter = Counter()  # why chains of async steps drained, by rule
        self.cycle_costs: dict[str, list] = {}  # _count_cycle
        self._observed_kind: tuple | None = None  # (padded, drafts, mode) of the step the policy saw last

    # ----------------------------------------------------------- admission
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError naming the
        problem (the engine's other requests are unaffected)."""
        req = self.make_request(prompt, params, request_id)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.admit(req)
        return req.request_id

    def admit(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, "abort")
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._observe_cycle(t0)
        if not self._inflight:
            if self.rest.waking:
                self._wake_drafter()
            plan = self._shape_admission(self.scheduler.schedule())
            if not self._async_eligible(plan):
                return self._sync_step(plan, t0)
            self._inflight = self._start_lanes(self.lane_split([d.request for d in plan.decode]))
        # Enqueue the next steps before reading these ones' results, so the
        # GPU runs them while the host applies these (async_decode.py).
        prev = self._inflight
        everyone = [r for p in prev for r in p.requests]
        chained = self._can_chain(everyone)
        joined_outputs, joins_before = None, self.num_chain_joins
        if chained and self._join_next:
            self._inflight = []
            # a prefill step whose launch of the next step takes the requests in
            joined_outputs = join_chain(self, everyone, self._join_next, t0)
            self._observed_kind = None  # the cycle carries a prefill: the policy does not time it
        if joined_outputs is None:
            drafts = self.speculate(everyone) if chained else None
            self._inflight = [launch_decode(self, p.requests, chained=True, lane=p.lane, drafts=drafts)
                              for p in prev] if chained else []
        if not chained:
            self._join_lanes()
        for p in prev:  # a bounded wait (NCCL) reads every lane before any is applied: a lost drafter drops all
            wait = result_wait(self, p.captured)
            if wait is not None:
                p.wait(wait)
        outputs = (joined_outputs or []) + [o for p in prev for o in self._apply_inflight(p, chained=chained)]
        gpu_s = sum(p.gpu_seconds() for p in prev)
        self.async_gpu_s += gpu_s
        if self._inflight and all(r.finished for p in self._inflight for r in p.requests):
            self._inflight = []  # their results belong to no one
        self.num_async_steps += 1
        # A cycle that captured the graph of a step it launched did not cost
        # what a step costs: the policy leaves it out.
        captured = any(p.timing is None for p in self._inflight)
        self._cycle = (t0, prev) if self._inflight and not captured else None
        self.last_step = StepStats(len(everyone), 0, time.perf_counter() - t0)
        if chained and not captured:
            self.join_wait.observe(1000 * self.last_step.total, self.num_chain_joins - joins_before)
        self.async_wall_s += self.last_step.total
        self._count_cycle(prev, joined_outputs is not None, outputs, gpu_s)
        return outputs

    def _count_cycle(self, applied: list[InflightStep], joined: bool, outputs: list[RequestOutput],
                     gpu_s: float) -> None:
        """``cycle_costs``: the async cycles by the kind and padded size of
        the step they applied and whether requests joined in them: count,
        wall and GPU seconds, tokens emitted (where a speculative engine's
        time goes, beside the policy's own view: bench/concurrency_sweep.py)."""
        p = applied[0]
        key = step_key(p.padded, p.drafts, self.block_size - 1)
        key += "+join" if joined else ""
        c = self.cycle_costs.setdefault(key, [0, 0.0, 0.0, 0])
        c[0] += 1
        c[1] += self.last_step.total
        c[2] += gpu_s
        c[3] += sum(len(o.delta_token_ids) for o in outputs)

    def _shape_admission(self, plan):
        """A step that admits prompts while others decode runs the prompts
        alone when those decode rows could run as step graphs: beside a
        prefill they would verify their drafts in a synchronous step, which
        costs several graphed steps and, under request churn (a closed
        loop at c=16 admits a request every few steps), is a large share
        of the steps. They wait, then rejoin the chain with the new
        requests. And up to ``lone_prefills`` prompts admitted together are
        prefilled one a step, each through a captured prefill graph (a step
        of several prompts runs eagerly). A prompt prefilled in chunks
        keeps its chunks beside the decode rows, so a long prompt cannot
        stall them."""
        if plan.preempted or not plan.prefill or not all(p.is_last_chunk for p in plan.prefill):
            return plan
        if plan.decode:
            if self.drafter is None or not self.async_capable([d.request for d in plan.decode]):
                return plan
            plan.decode = []
        if 1 < len(plan.prefill) <= self.config.lone_prefills and self._lone_prefill_graphs(plan.prefill):
            plan.prefill = plan.prefill[:1]  # the others stay admitted: the next steps prefill them
        return plan

    def _lone_prefill_graphs(self, items) -> bool:
        """Whether each of these prompt chunks, alone in a step, runs as a
        captured prefill graph (actors/target.py) rather than eagerly."""
        graphs = getattr(getattr(self.target, "worker", self.target), "prefill_graphs", None)
        if not graphs or (self.device.type != "cuda" and not self.lone_prefills_off_cuda):
            return False
        return all(p.end - p.start <= max(graphs) for p in items)

    def _sync_step(self, plan, t0: float, launch_chain=None) -> list[RequestOutput]:
        """``launch_chain(first_tokens)``: launches the chain step that
        follows this prefill (``join_chain``), in place of ``chain_from_prefill``."""
        stats = StepStats(len(plan.decode), sum(p.end - p.start for p in plan.prefill))
        if plan.empty:
            self.last_step = stats
            return []
        decode = plan.decode
        params = [d.request.params for d in decode]
        # A verify block reads the uniforms of its block_size positions after
        # the request's computed length, the drafter the first block_size - 1.
        st_cpu = SamplingTensors.build(params, [d.request.seed for d in decode],
                                       [d.request.num_computed for d in decode], self.block_size,
                                       vocab_size=self.target_spec.vocab_size)
        # One copy to the device serves an in-process drafter and the
        # verification (nothing is copied for an all-greedy batch); a
        # drafter behind a channel packs the host tensors.
        st_dev = st_cpu.to(self.device)

        drafts = lookup = None
        if self.drafter is not None and decode:
            tree = self._tree_step(decode)
            lookup = self._lookup_drafts(decode)
            # A step where every request has a lookup draft skips the
            # drafter, unless lookups need its agreement or join a tree.
            if tree or self.config.prompt_lookup_agree or not all(lookup):
                draft_batch = self._draft_batch(decode, st_cpu if getattr(self.drafter, "packs_host_batch", False)
                                                else st_dev, lookup if tree else None)
                self._sync()
                t = time.perf_counter()
                drafts = self.drafter.propose(draft_batch)
                self._sync()
                stats.propose = time.perf_counter() - t
            if any(lookup) and (drafts is None or drafts.tree is None):
                drafts = merge_lookup_drafts(drafts, lookup, self.block_size - 1, st_cpu, self.device,
                                             self.config.prompt_lookup_agree)

        batch, draft_dst, draft_src, logit_rows = self._target_batch(decode, plan.prefill)
        if drafts is not None:
            batch.input_ids = host_to_device(batch.input_ids, self.device)
            if batch.uniform_rows:
                # Rows past a cut-short block write to the reserved slot and
                # are never read, so every row 1.. may take its draft.
                batch.input_ids.view(len(decode), -1)[:, 1:] = drafts.tokens.to(self.device)
            else:
                dst, src = host_to_device(draft_dst, self.device), host_to_device(draft_src, self.device)
                batch.input_ids[dst] = drafts.tokens.reshape(-1)[src]
            if drafts.tree is not None:
                self._place_tree(batch, drafts.tree, draft_dst, draft_src)
        self._sync()
        t = time.perf_counter()
        logits = self.target.execute(batch)
        logprob_rows = self._logprob_rows(decode, plan.prefill, logits, logit_rows, batch.uniform_rows)
        self._penalize(decode, plan.prefill, logits, logit_rows, batch.uniform_rows, drafts)
        self._mask_early_stops(decode, plan.prefill, logits, logit_rows, batch.uniform_rows)
        self._sync()
        stats.verify = time.perf_counter() - t

        accepted = self._accept(decode, plan.prefill, logits, logit_rows, drafts, st_dev, batch)
        # Prompts that finished here may start their chain of asynchronous
        # steps now, from their first tokens on the device (async_decode.py).
        chain = None
        if accepted.first_tokens is not None:
            chain = launch_chain(accepted.first_tokens) if launch_chain is not None else \
                chain_from_prefill(self, plan, accepted.first_tokens)
        results = accepted.read(result_wait(self))
        if lookup is not None:
            self._count_lookups(decode, lookup, results[2])
        logprobs = self._read_logprobs(logprob_rows, decode, plan.prefill, results) if logprob_rows else {}
        outputs = self._apply(decode, plan.prefill, results, batch, chained=chain is not None, logprobs=logprobs,
                              path_rows=accepted.path_rows)
        if chain is not None:
            self.num_prefill_chains += launch_chain is None
            if not all(r.finished for r in chain.requests):
                self._inflight = [chain]
        stats.total = time.perf_counter() - t0
        self.last_step = stats
        return outputs

    # ----------------------------------------------------------- draft trees
    def _tree_universe(self):
        """The rank paths draft trees are chosen from (draft_tree.py), or None
        where blocks stay chains."""
        if self.drafter is None or self.config.draft_tree is False:
            return None
        reason = tree_unsupported(self.block_size, self.target_spec.layer_window)
        if reason:
            if self.config.draft_tree:
                raise ConfigError(f"draft_tree {reason}")
            return None
        # A drafter in another process loads the same universe itself.
        universe = load_universe(self.drafter_spec.path, self.block_size - 1).to(self.device)
        self.drafter.tree = universe
        return universe

    def features(self) -> dict[str, dict]:
        """The speed features this engine runs, each ``{"on": bool}`` with
        the ``reason`` where it does not (logged at start-up, shown in the
        served model's metadata: a placement never drops one silently)."""
        def feature(on: bool, reason: str | None) -> dict:
            return {"on": True} if on else {"on": False, "reason": reason}

        cuda = self.device.type == "cuda"
        reason = None if cuda and self.config.cuda_graphs else "turned off (cuda_graphs=False)" if cuda else \
            "CUDA only (the CPU runs the same padded path eagerly)" if self.config.cuda_graphs else "CUDA only"
        out = {"cuda_graphs": feature(reason is None, reason)}
        target = getattr(self.target, "worker", self.target)
        if reason is None and getattr(target, "graphs", None) is None:
            out["cuda_graphs"]["note"] = "a target at TP > 1 replays decode steps as step graphs on every rank " \
                                         "(async_scheduling); prefills and synchronous steps run eagerly"
        out["async_scheduling"] = feature(self.async_capable([]), self._async_unsupported())
        if out["async_scheduling"]["on"] and cuda and self.drafter_apart():
            out["async_scheduling"]["note"] = "the drafter replays its half of the step graphs in its own " \
                "process: on one GPU (the CUDA IPC ring) its greedy tokens and seeded samples are the " \
                "in-process engine's; between GPUs (NCCL) not yet run (docs/architecture.md)"
        if self.drafter is not None:
            reason = "turned off (draft_tree=False)" if self.config.draft_tree is False else \
                tree_unsupported(self.block_size, self.target_spec.layer_window)
            out["draft_tree"] = feature(self.tree is not None, reason)
        if self.drafter is not None:
            out["adaptive_speculation"] = feature(self.policy is not None, self._adaptive_unsupported())
            if self.policy is not None:  # the draft counts a step may verify (0: autoregressive)
                out["adaptive_speculation"]["drafts"] = list(self.policy.options)
            out["drafter_rest"] = feature(self.rest.supported, self._rest_unsupported())
        out["overlap"] = feature(self._overlap_unsupported() is None, self._overlap_unsupported())
        if out["overlap"]["on"]:
            out["overlap"]["min_batch"] = self.config.overlap_min_batch
        out["admit_into_chain"] = feature(self._join_unsupported() is None, self._join_unsupported())
        if out["admit_into_chain"]["on"] and out["overlap"]["on"]:
            out["admit_into_chain"]["note"] = "one-lane chains only (batches below overlap_min_batch)"
        return out

    def _join_unsupported(self) -> str | None:
        """Why waiting requests may not join running chains (chain_admit.py)."""
        if not self.config.admit_into_chain:
            return "turned off (admit_into_chain=False)"
        if self._async_unsupported() is not None:
            return "needs async_scheduling"
        return None

    # --------------------------------------------------------------- apply
    def _sync(self) -> None:
        if self.config.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _apply(self, decode, prefill, results, batch, chained: bool = False,
               logprobs: dict | None = None, path_rows: list[list[int]] | None = None) -> list[RequestOutput]:
        """``chained``: the prompts' first decode step is in flight
        (``chain_from_prefill``), their context stored already.
        ``logprobs``: the emitted tokens' entries of the requests that asked.
        ``path_rows``: with draft trees, the block rows of each row's
        accepted nodes, by depth."""
        logprobs = logprobs or {}
        n_acc, bonus, drafts, firsts = results
        outputs: list[RequestOutput] = []
        ctx_rows, ctx_pos, ctx_slots = [], [], []
        uniform = batch.uniform_rows
        # A drafter with a context graph takes whole verify blocks (its
        # graph's shape), rejected rows pointed at the reserved slot.
        whole = bool(uniform) and self.drafter is not None and self.drafter.stores_whole_blocks
        row = 0
        for s, d in enumerate(decode):
            r = d.request
            a, start = n_acc[s], r.num_computed
            try:
                outputs.append(self._emit(r, drafts[s], a, bonus[s], d.block_len - 1,
                                          logprobs=logprobs.get(r.request_id)))
            except Exception as e:  # its own host code: it fails alone (faults.py)
                outputs.append(fail_request(self, r, format_error(e)))
            kept = 0 if r.finished else a + 1
            if self.drafter is not None:
                # The block rows of the anchor and the accepted drafts, in
                # position order (a draft tree's accepted path).
                kept_rows = list(range(kept)) if path_rows is None else ([0] + path_rows[s][:a])[:kept]
                slots = r.draft_blocks.slots(start, start + kept)
                if whole:
                    pos, row_slots = list(range(start, start + uniform)), [0] * uniform
                    for k, j in enumerate(kept_rows):
                        pos[j], row_slots[j] = start + k, slots[k]
                    ctx_pos.extend(pos)
                    ctx_slots.extend(row_slots)
                else:
                    ctx_rows.extend(row + j for j in kept_rows)
                    ctx_pos.extend(range(start, start + kept))
                    ctx_slots.extend(slots)
            row += uniform or d.block_len
        first_iter = iter(firsts)
        for p in prefill:
            r = p.request
            if self.drafter is not None:
                ctx_rows.extend(range(row, row + p.end - p.start))
                ctx_pos.extend(range(p.start, p.end))
                ctx_slots.extend(r.draft_blocks.slots(p.start, p.end))
            row += p.end - p.start
            self.scheduler.commit(r, p.end, keep=p.end + self.block_size if chained else None)
            # A resumed request's re-prefill adds no token: nothing to report.
            if p.samples_first_token:
                first = next(first_iter)
                try:
                    self._append(r, [first], logprobs.get(r.request_id))
                    outputs.append(self._output(r))
                except Exception as e:
                    outputs.append(fail_request(self, r, format_error(e)))
        if chained:  # stored before the chain's first step was launched
            return self._forget_finished(outputs)
        if whole:
            self.store_context(None, ctx_pos, ctx_slots)
        elif ctx_rows:
            # Increasing and distinct: as many as the forward's rows is all of them (a prefill alone).
            self.store_context(None if len(ctx_rows) == row else ctx_rows, ctx_pos, ctx_slots)
        return self._forget_finished(outputs)

    def store_context(self, rows: list[int] | None, positions: list[int], slots: list[int]) -> None:
        """The drafter's context of the last forward's tapped ``rows`` (all
        of them for None) at ``positions``, into its cache ``slots``."""
        self.drafter.store_context(
            self.target.hidden_rows(None if rows is None else int64_tensor(rows)),
            int64_tensor(positions),
            int64_tensor(slots),
        )

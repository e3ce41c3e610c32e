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
import dataclasses
import operator
import random
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from specray.actors.kv_cache import BlockAllocator, block_table_tensor
from specray.async_decode import HistorySlots, InflightStep, ResultBuffers, chain_from_prefill, launch_decode
from specray.config import ConfigError, DrafterSpec, EngineConfig, TargetSpec
from specray.detokenizer import (
    detokenize_step,
    find_stop_string,
    init_detokenizer,
    max_prompt_chars,
    stop_holdback,
)
from specray.draft_tree import accept_greedy, kv_moves, load_universe, path_tokens
from specray.faults import fail_request, format_error
from specray.kernels import ops
from specray.logprobs import LogprobRows
from specray.penalties import penalize
from specray.plan import AttentionMetadata, DraftBatch, TargetBatch
from specray.request import Request, RequestOutput, check_prompt_length
from specray.prompt_lookup import NgramIndex, lookup_rows, merge_lookup_drafts
from specray.sampling import SamplingParams, SamplingTensors, verify
from specray.staging import host_to_device
from specray.scheduler import DecodeItem, PrefillItem, Scheduler


@dataclass
class StepStats:
    """Wall time of the last step and of its model passes (seconds)."""

    num_decode: int = 0
    num_prefill_tokens: int = 0
    total: float = 0.0
    propose: float = 0.0
    verify: float = 0.0


def _token_ids(prompt) -> list[int]:
    """A token-id prompt as ints: integers only (numpy's too); 1.7, "1" or
    True are no token ids."""
    if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = []
    for i, t in enumerate(prompt):
        try:
            if isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool:  # a bool tensor has __index__
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r} at index {i}") from None
    return ids


@dataclass
class AcceptedOnDevice:
    """A synchronous step's results, being copied to the host."""

    host: torch.Tensor  # [2S + S*G (+ S*G) + P]: accepted counts, bonus tokens, drafts, (path rows,) first tokens
    ready: torch.cuda.Event | None
    S: int  # decode rows
    G: int  # drafts a row
    first_tokens: torch.Tensor | None  # [P] on the device: first tokens of the prompts this step finished
    tree: bool = False  # draft trees: the drafts are the accepted paths', their block rows follow
    path_rows: list[list[int]] | None = None  # set by read() for trees

    def read(self) -> tuple[list[int], list[int], list[list[int]], list[int]]:
        if self.ready is not None:
            self.ready.synchronize()
        host, S, G = self.host.tolist(), self.S, self.G
        drafts = host[2 * S : 2 * S + S * G]
        end = 2 * S + S * G
        if self.tree:
            rows = host[end : end + S * G]
            self.path_rows = [rows[s * G : (s + 1) * G] for s in range(S)]
            end += S * G
        return host[:S], host[S : 2 * S], [drafts[s * G : (s + 1) * G] for s in range(S)], host[end:]


class EngineCore:
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
        self._encoder = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self._encoder_lock = threading.Lock()
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len - 1)
        self.last_step = StepStats()
        self._inflight: InflightStep | None = None  # an asynchronous step not yet applied
        self._step_graphs = {}
        self._step_buffers: dict[str, torch.Tensor] = {}  # inputs the step graphs of every sampling kind share
        self.history_slots = HistorySlots(self.config.max_num_seqs)  # requests' rows of the graphs' token history
        self.result_buffers = ResultBuffers()  # pinned copies of steps' results
        self.uploaded_tables: list[list[int]] = []  # what the step graphs' block tables hold
        self.num_async_steps = 0
        self.num_prefill_chains = 0  # chains whose first step was launched from a prefill's device tokens
        self.tree = self._tree_universe()

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

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Validate and tokenize without touching engine state (safe to call
        from another thread than the one stepping)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        # The request keeps its own copy, validated again: a caller may reuse
        # and change its object for the next request, and a field made
        # invalid after construction must be refused here, not fail a step
        # that every request in flight shares.
        params = dataclasses.replace(params)
        request_id = request_id or uuid.uuid4().hex
        prompt_text, ids = self._tokenize(prompt)
        check_prompt_length(ids, self.max_model_len, self.max_prompt_chars)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, prompt_text, ids, params, seed, self.target_spec.eos_token_ids)
        init_detokenizer(req)
        return req

    def admit(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the target checkpoint ships no tokenizer: pass token ids as the prompt")
            check_prompt_length(prompt, self.max_model_len, self.max_prompt_chars)
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid Unicode text ({e.reason} at character {e.start})") from None
            with self._encoder_lock:
                ids = self._encoder.encode(prompt, add_special_tokens=True)
            text = prompt
        else:
            ids = _token_ids(prompt)
            text = None
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.target_spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return text, ids

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
        if self._inflight is None:
            plan = self.scheduler.schedule()
            if not self._async_eligible(plan):
                return self._sync_step(plan, t0)
            self._inflight = launch_decode(self, [d.request for d in plan.decode], chained=False)
        # Enqueue the next step before reading this one's results, so the GPU
        # runs it while the host applies them (async_decode.py).
        prev = self._inflight
        self._inflight = launch_decode(self, prev.requests, chained=True) if self._can_chain(prev) else None
        outputs = self._apply_inflight(prev, chained=self._inflight is not None)
        if self._inflight is not None and all(r.finished for r in self._inflight.requests):
            self._inflight = None  # its results belong to no one
        self.num_async_steps += 1
        self.last_step = StepStats(len(prev.requests), 0, time.perf_counter() - t0)
        return outputs

    def _sync_step(self, plan, t0: float) -> list[RequestOutput]:
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
        chain = chain_from_prefill(self, plan, accepted.first_tokens) if accepted.first_tokens is not None else None
        results = accepted.read()
        if lookup is not None:
            self._count_lookups(decode, lookup, results[2])
        logprobs = self._read_logprobs(logprob_rows, decode, plan.prefill, results) if logprob_rows else {}
        outputs = self._apply(decode, plan.prefill, results, batch, chained=chain is not None, logprobs=logprobs,
                              path_rows=accepted.path_rows)
        if chain is not None:
            self.num_prefill_chains += 1
            if not all(r.finished for r in chain.requests):
                self._inflight = chain
        stats.total = time.perf_counter() - t0
        self.last_step = stats
        return outputs

    # ----------------------------------------------------------- draft trees
    def _tree_universe(self):
        """The rank paths draft trees are chosen from (draft_tree.py), or None
        where blocks stay chains."""
        if self.drafter is None or self.config.draft_tree is False:
            return None
        reason = None
        if not all(getattr(w, "local_model", False) for w in (self.target, self.drafter)):
            reason = "needs the target (TP 1) and the drafter in one process"
        elif any(self.target_spec.layer_window):
            reason = "is not built for sliding-window attention"
        elif self.block_size > 32:
            reason = f"handles blocks of at most 32 rows, not {self.block_size}"
        elif self.block_size < 3:
            reason = "needs at least two drafts a block"
        if reason:
            if self.config.draft_tree:
                raise ConfigError(f"draft_tree {reason}")
            return None
        universe = load_universe(self.drafter_spec.path, self.block_size - 1).to(self.device)
        self.drafter.tree = universe
        return universe

    def _tree_step(self, decode: list[DecodeItem]) -> bool:
        """Whether this step's blocks hold draft trees: every row greedy, and
        none needing what walks a chain's rows (min_tokens' mask, log
        probabilities, penalties)."""
        return self.tree is not None and all(
            d.request.params.greedy and not d.request.reads_verify_rows for d in decode)

    def _place_tree(self, batch, tree, draft_dst: torch.Tensor, draft_src: torch.Tensor) -> None:
        """Positions (the anchor's plus each node's depth) and attention
        masks (ancestors only) of the drafted rows."""
        dev, G = self.device, tree.depth.shape[1]
        attn = batch.attn
        anchor = attn.positions[draft_dst] - draft_src % G - 1  # host: row j sits at anchor + j
        dst, src = host_to_device(draft_dst, dev), host_to_device(draft_src, dev)
        attn.positions = host_to_device(attn.positions, dev)
        attn.positions[dst] = host_to_device(anchor, dev) + tree.depth.reshape(-1)[src]
        mask = torch.full(batch.input_ids.shape, -1, dtype=torch.int32, device=dev)
        mask[dst] = tree.masks[:, 1:].reshape(-1)[src]
        attn.tree_mask = mask

    # ------------------------------------------------------ asynchronous steps
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
        if not self.config.async_scheduling or self.config.sync_timing:
            return False
        if any(r.reads_verify_rows for r in requests):
            return False
        if self.config.prompt_lookup_min and self.config.prompt_lookup_sampled and \
                not all(r.params.greedy for r in requests):
            return False  # a sampled row's lookup draft needs its one-hot q: synchronous steps have it
        workers = [self.target] + ([self.drafter] if self.drafter is not None else [])
        return all(getattr(w, "local_model", False) for w in workers)

    def step_graphs(self, sampling: str):
        """The whole-step graphs of the in-process target and drafter, for
        batches whose ``sampling`` is "greedy", "sampled" or "filtered"."""
        if sampling not in self._step_graphs:
            from specray.actors.step_graph import build_step_graphs

            target = getattr(self.target, "worker", self.target)
            self._step_graphs[sampling] = build_step_graphs(
                target, self.drafter, self.block_size, self.config.max_num_seqs, self.config.kv_block_size,
                self.drafter_spec.mask_token_id if self.drafter_spec else None,
                lookup=(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
                if self.config.prompt_lookup_min else None, lookup_agree=self.config.prompt_lookup_agree,
                sampling=sampling, draft_top_k=self.config.draft_top_k, shared=self._step_buffers,
                tree=self.tree if sampling == "greedy" else None,
            )
        return self._step_graphs[sampling]

    def _can_chain(self, prev: InflightStep) -> bool:
        """Whether the step after ``prev`` may be launched before ``prev``'s
        results are applied: the same rows, none finished, none near a
        length limit, no waiting request that scheduling would admit now (one
        that does not fit waits for a finish, which drains), and room to
        reserve every row's blocks two verify blocks ahead."""
        sched, B = self.scheduler, self.block_size
        if len(sched.running) != len(prev.requests) or sched.could_admit(len(prev.requests) * B):
            return False
        for r in prev.requests:
            # The host's view lags ``prev``: it may advance by up to B, and
            # its next block needs B rows more.
            if r.finished or r.num_computed + 2 * B > self.max_model_len:
                return False
            if r.params.max_tokens - len(r.output_token_ids) <= 1:
                return False  # ``prev`` emits at least one token, the last
        return all(sched.reserve(r, r.num_computed + 2 * B) for r in prev.requests)

    def _apply_inflight(self, step: InflightStep, chained: bool) -> list[RequestOutput]:
        """Apply an asynchronous step's tokens. With the next step in flight
        its blocks stay reserved; rows of requests that finished meanwhile
        are dropped."""
        outputs = []
        for r, (a, bonus, looked_up, drafts) in zip(step.requests, step.read()):
            if r.finished:
                continue
            # The block the graph verified, cut as the scheduler cuts it from
            # the host's view when the step was launched (it is now).
            num_drafts = self.scheduler.block_len(r) - 1
            r.metrics.num_lookup_steps += looked_up
            try:
                outputs.append(self._emit(r, drafts, a, bonus, num_drafts, self.block_size if chained else 0))
            except Exception as e:
                outputs.append(fail_request(self, r, format_error(e)))
        return self._forget_finished(outputs)

    def _emit(self, r: Request, drafts: list[int], a: int, bonus: int, num_drafts: int,
              keep_ahead: int = 0, logprobs: list | None = None) -> RequestOutput:
        """A decode row's result: its first ``a`` drafts and the bonus token
        are appended (up to a stop), the step recorded, and the request's
        blocks rolled back past what was accepted (keeping ``keep_ahead``
        more positions for a step in flight)."""
        produced = self._append(r, drafts[:a] + [bonus], logprobs)
        r.metrics.record_step(num_drafts, min(a, produced), produced)
        if not r.finished:
            computed = r.num_computed + a + 1
            self.scheduler.commit(r, computed, keep=computed + keep_ahead)
        return self._output(r)

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outputs

    def _sync(self) -> None:
        if self.config.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _lookup_drafts(self, decode: list[DecodeItem]) -> list[list[int]]:
        """Each request's prompt-lookup draft ([] for none, and for sampled
        requests unless prompt_lookup_sampled; a request that drafts nothing
        this step counts as having one)."""
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        if not lo:
            return [[] for _ in decode]
        out = []
        for d in decode:
            r = d.request
            if d.block_len <= 1:
                out.append([r.output_token_ids[-1]])
                continue
            if not (r.params.greedy or self.config.prompt_lookup_sampled):
                out.append([])
                continue
            if r.lookup_index is None:
                r.lookup_index = NgramIndex(lo, hi)
            out.append(r.lookup_index.propose(r.prompt_token_ids, r.output_token_ids, self.block_size - 1))
        return out

    def _count_lookups(self, decode: list[DecodeItem], lookup: list[list[int]], drafted: list[list[int]]) -> None:
        """Count the steps whose drafts were a lookup's. One that had to
        agree with the drafter was taken iff the step's first draft is the
        lookup's first token (the drafter's differed otherwise)."""
        agree = self.config.prompt_lookup_agree and not self._tree_step(decode)  # a tree takes every lookup
        for d, found, tokens in zip(decode, lookup, drafted):
            taken = not agree or not d.request.params.greedy or tokens[:1] == found[:1]
            d.request.metrics.num_lookup_steps += bool(found) and taken

    def _draft_batch(self, decode: list[DecodeItem], st: SamplingTensors,
                     tree_lookup: list[list[int]] | None = None) -> DraftBatch:
        """``tree_lookup``: draft trees, with each row's lookup draft ([] for
        none) as a branch."""
        B = self.block_size
        lookup = has = None
        if tree_lookup is not None and any(tree_lookup):
            lookup = lookup_rows(tree_lookup, B - 1)
            has = torch.tensor([bool(d) and dl.block_len > 1 for d, dl in zip(tree_lookup, decode)])
        mask = self.drafter_spec.mask_token_id
        block_ids = torch.full((len(decode), B), mask, dtype=torch.int64)
        block_ids[:, 0] = torch.tensor([d.request.all_token_ids[-1] for d in decode])
        ctx = [d.request.num_computed for d in decode]
        return DraftBatch(
            block_ids=block_ids,
            ctx_lens=torch.tensor(ctx, dtype=torch.int64),
            block_lens=torch.tensor([d.block_len for d in decode], dtype=torch.int64),
            block_tables=block_table_tensor([d.request.draft_blocks.blocks for d in decode]),
            max_ctx_len=max(ctx),
            sampling=st,
            tree=tree_lookup is not None,
            tree_lookup=lookup,
            tree_has_lookup=has,
        )

    def _target_batch(self, decode: list[DecodeItem], prefill: list[PrefillItem]):
        """Flatten verify blocks and prefill chunks into one TargetBatch.

        Also returns where draft tokens go in ``input_ids`` (``draft_dst``),
        which draft each one is (``draft_src``, flat index into the
        ``[S, B-1]`` drafts), and ``logit_rows``: the ``[S, Bmax]`` rows of
        the logits that hold each verify block (padded with its first row),
        followed by one row per prefill chunk that samples.

        A decode-only step with ``cuda_graphs`` gives every block the full
        ``B`` rows (the extra rows write to the reserved block 0 and are never
        read), so its shapes depend on the batch size alone."""
        uniform = self.config.cuda_graphs and not prefill
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        draft_dst, draft_src, logits_indices = [], [], []
        bmax = max((d.block_len for d in decode), default=1)
        verify_rows = []
        G = self.block_size - 1
        for s, d in enumerate(decode):
            r = d.request
            base = len(ids)
            rows = self.block_size if uniform else d.block_len
            ids.append(r.all_token_ids[-1])
            ids.extend([0] * (rows - 1))
            draft_dst.extend(range(base + 1, base + d.block_len))
            draft_src.extend(range(s * G, s * G + d.block_len - 1))
            positions.extend(range(r.num_computed, r.num_computed + rows))
            slots.extend(r.target_blocks.slots(r.num_computed, r.num_computed + d.block_len))
            slots.extend([0] * (rows - d.block_len))
            seq_lens.append(r.num_computed + rows)
            tables.append(r.target_blocks.blocks)
            first = len(logits_indices)
            verify_rows.append(list(range(first, first + d.block_len)) + [first] * (bmax - d.block_len))
            logits_indices.extend(range(base, base + rows))
            starts.append(len(ids))
        sample_rows = []
        for p in prefill:
            r = p.request
            ids.extend(r.all_token_ids[p.start : p.end])
            positions.extend(range(p.start, p.end))
            slots.extend(r.target_blocks.slots(p.start, p.end))
            seq_lens.append(p.end)
            tables.append(r.target_blocks.blocks)
            if p.samples_first_token:
                sample_rows.append(len(logits_indices))
                logits_indices.append(len(ids) - 1)
            starts.append(len(ids))
        q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        attn = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=block_table_tensor(tables),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        batch = TargetBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            attn=attn,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            want_hidden=self.drafter is not None,
            uniform_rows=self.block_size if uniform else 0,
        )
        logit_rows = (torch.tensor(verify_rows, dtype=torch.int64), torch.tensor(sample_rows, dtype=torch.int64))
        return batch, torch.tensor(draft_dst, dtype=torch.int64), torch.tensor(draft_src, dtype=torch.int64), logit_rows

    @staticmethod
    def _rows_of(decode, prefill, logit_rows, uniform_rows: int, wants) -> list[tuple[Request, list[int], int | None]]:
        """``(request, its logits rows, its decode row)`` for each request of
        the step that ``wants``: a decode row's verify block (row ``j``
        predicts its output token ``len(output) + j``), a prompt's
        first-token row (decode row None)."""
        verify_rows, sample_rows = logit_rows
        out = []
        for s, d in enumerate(decode):
            if wants(d.request):
                if uniform_rows:  # sequence s owns rows s*B .. s*B+B-1
                    rows = [s * uniform_rows + j for j in range(d.block_len)]
                else:
                    rows = verify_rows[s, : d.block_len].tolist()
                out.append((d.request, rows, s))
        for k, r in enumerate(p.request for p in prefill if p.samples_first_token):
            if wants(r):
                out.append((r, [int(sample_rows[k])], None))
        return out

    def _penalize(self, decode, prefill, logits, logit_rows, uniform_rows: int, drafts) -> None:
        """Presence / frequency / repetition penalties on the rows of the
        requests that set them (penalties.py)."""
        groups = self._rows_of(decode, prefill, logit_rows, uniform_rows, lambda r: r.params.penalized)
        penalize(logits, groups, drafts.tokens if drafts is not None else None)

    def _mask_early_stops(self, decode, prefill, logits, logit_rows, uniform_rows: int) -> None:
        """Stop tokens get no probability (logit -inf) in the rows that
        predict a request's output tokens before its ``min_tokens``; the
        verification then accepts, and samples, what an autoregressive step
        under the same mask would."""
        vocab = logits.shape[-1]
        rows, cols = [], []
        for r, r_rows, _ in self._rows_of(decode, prefill, logit_rows, uniform_rows, lambda r: r.min_tokens_left):
            stops = [t for t in sorted(r.stop_token_ids) if 0 <= t < vocab]
            for row in r_rows[: r.min_tokens_left]:
                rows.extend([row] * len(stops))
                cols.extend(stops)
        if rows:
            rows_cols = host_to_device(torch.tensor([rows, cols], dtype=torch.int64), logits.device)
            with torch.inference_mode():  # the workers' outputs are inference tensors
                logits.index_put_((rows_cols[0], rows_cols[1]),
                                  torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))

    def _logprob_rows(self, decode, prefill, logits, logit_rows, uniform_rows: int) -> LogprobRows | None:
        """The log-softmax rows of the requests that asked for log
        probabilities, taken before the min_tokens mask (raw logprobs)."""
        wanted = self._rows_of(decode, prefill, logit_rows, uniform_rows, lambda r: r.params.logprobs is not None)
        return LogprobRows.take(logits, [(r, rows) for r, rows, _ in wanted])

    @staticmethod
    def _read_logprobs(rows: LogprobRows, decode, prefill, results) -> dict:
        """The entries of the tokens each asking request emitted this step
        (a decode row's accepted drafts and bonus; a prompt's first token)."""
        n_acc, bonus, drafts, firsts = results
        emitted = {}
        for s, d in enumerate(decode):
            emitted[d.request.request_id] = drafts[s][: n_acc[s]] + [bonus[s]]
        for p, first in zip((p for p in prefill if p.samples_first_token), firsts):
            emitted[p.request.request_id] = [first]
        return rows.read([emitted[r.request_id] for r in rows.requests])

    def _accept(self, decode, prefill, logits, logit_rows, drafts, st, batch) -> "AcceptedOnDevice":
        """Accepted counts, emitted bonus tokens and first tokens of
        finished prefills, on their way to the host in one transfer."""
        dev = logits.device
        verify_rows, sample_rows = logit_rows
        parts = []
        S = len(decode)
        G = verify_rows.shape[1] - 1 if S else 0  # drafts of the longest block
        tree = S and drafts is not None and drafts.tree is not None
        if S:
            num_drafts = host_to_device(torch.tensor([d.block_len - 1 for d in decode]), dev)
            if batch.uniform_rows:  # sequence s owns rows s*B .. s*B+B-1, in order
                target_logits = logits.view(S, batch.uniform_rows, -1)[:, : G + 1]
            else:
                target_logits = logits[host_to_device(verify_rows, dev)]
        if tree:
            G = drafts.tokens.shape[1]
            parts += self._accept_tree(decode, target_logits, num_drafts, drafts, batch)
        elif S:
            if drafts is not None:
                draft_tokens = drafts.tokens[:, :G].to(dev)
                idx = drafts.draft_idx[:, :G].to(dev) if drafts.draft_idx is not None else None
                q = drafts.draft_q[:, :G].to(dev) if drafts.draft_q is not None else None
            else:
                draft_tokens, idx, q = torch.zeros(S, 0, dtype=torch.long, device=dev), None, None
            res = verify(target_logits, draft_tokens, num_drafts, st, idx, q)
            parts += [res.num_accepted, res.bonus, draft_tokens.reshape(-1)]
        sampling = [p for p in prefill if p.samples_first_token]
        if sampling:
            ps = [p.request.params for p in sampling]
            st = SamplingTensors.build(ps, [p.request.seed for p in sampling], [p.end - 1 for p in sampling], 1, dev,
                                       vocab_size=self.target_spec.vocab_size)
            no_drafts = torch.zeros(len(sampling), 0, dtype=torch.long, device=dev)
            zeros = torch.zeros(len(sampling), dtype=torch.long, device=dev)
            first = verify(logits[host_to_device(sample_rows, dev)][:, None], no_drafts, zeros, st)
            parts.append(first.bonus)
        flat = torch.cat([p.reshape(-1).long() for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        # Copied out before anything else is enqueued: the host waits for
        # this step's results only, not for a chain launched after it.
        host, ready = self.result_buffers.fetch(flat) if flat.is_cuda else (flat, None)
        return AcceptedOnDevice(host, ready, S, G, first.bonus if sampling else None, tree=bool(tree))

    def _accept_tree(self, decode, target_logits, num_drafts, drafts, batch) -> list[torch.Tensor]:
        """Greedy acceptance over draft trees, from the verify blocks' logits
        ``[S, longest block, V]``; the accepted nodes' target K/V move to
        their positions' slots. Returns the device parts of the results:
        accepted counts, bonus tokens, the paths' drafts and block rows."""
        dev, S = target_logits.device, len(decode)
        B = drafts.tokens.shape[1] + 1
        target_argmax = ops.argmax(target_logits)
        if target_argmax.shape[1] < B:  # rows past every block: no real node has its parent there
            target_argmax = torch.nn.functional.pad(target_argmax, (0, B - target_argmax.shape[1]))
        acc = accept_greedy(target_argmax, drafts.tokens, drafts.tree, num_drafts)
        # Block row j of sequence s is token query_start_loc[s] + j; rows past
        # a cut-short block stand for its row 0 (they only copy onto themselves).
        j = torch.arange(B)
        lens = torch.tensor([d.block_len for d in decode])
        rows = batch.attn.query_start_loc[:S, None] + torch.where(j[None] < lens[:, None], j[None], 0)
        row_slots = host_to_device(batch.attn.slot_mapping[rows], dev)
        self.target.move_kv(*kv_moves(row_slots, acc.path_rows))
        return [acc.num_accepted, acc.bonus, path_tokens(drafts.tokens, acc.path_rows).reshape(-1),
                acc.path_rows.reshape(-1)]

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
            self.target.hidden_rows(None if rows is None else torch.tensor(rows, dtype=torch.int64)),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
        )

    def _append(self, r: Request, tokens: list[int], logprobs: list | None = None) -> int:
        """Append emitted tokens (and their ``logprobs`` entries) one by one,
        stopping at the first stop condition; returns how many were kept."""
        stops = r.stop_token_ids
        kept = 0
        for tok in tokens:
            r.output_token_ids.append(tok)
            if logprobs is not None:
                r.logprobs.append(logprobs[kept])
            kept += 1
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = time.monotonic()
            # A stop token's text stays out of the output, as in vLLM (the
            # token still counts in token_ids and usage).
            # Before min_tokens a stop token is text like any other (the
            # verification masks stop tokens there, so none is emitted) and
            # stop strings are not looked for (vLLM's rule).
            stopping = tok in stops and len(r.output_token_ids) > r.params.min_tokens
            new_text = ""
            if not stopping:
                with self.tokenizer_lock:
                    new_text = detokenize_step(self.tokenizer, r)
                r.text += new_text
            reason = None
            if stopping:
                reason, r.stop_reason = "stop", tok
            elif new_text and r.params.stop and len(r.output_token_ids) >= r.params.min_tokens and \
                    (hit := find_stop_string(r, len(new_text))):
                r.text = r.text[: hit[0]]
                reason, r.stop_reason = "stop", hit[1]
            elif len(r.output_token_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                self.scheduler.finish(r, reason)
                r.metrics.finished_time = time.monotonic()
                break
        return kept

    def _output(self, r: Request) -> RequestOutput:
        visible = len(r.text) - stop_holdback(r)
        delta_text = r.text[r.sent_text_len : max(visible, r.sent_text_len)]
        r.sent_text_len = max(visible, r.sent_text_len)
        delta_ids = r.output_token_ids[r.sent_token_len :]
        asked = r.params.logprobs is not None
        # New entries every time, all of them once: a stream's outputs cross
        # processes (the Ray backend), and the whole list each step would
        # make a long generation's traffic quadratic.
        delta_logprobs = r.logprobs[r.sent_token_len :] if asked else None
        r.sent_token_len = len(r.output_token_ids)
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,
            text=r.text,
            token_ids=list(r.output_token_ids),
            finished=r.finished,
            finish_reason=r.finish_reason,
            metrics=r.metrics,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            stop_reason=r.stop_reason,
            delta_logprobs=delta_logprobs,
            logprobs=list(r.logprobs) if asked and r.finished else None,
        )

"""One CUDA graph for a whole decode step on target rank 0: drafter
propose, target verify, acceptance, drafter context store, and the next
step's inputs.

Each replay reads every row's block start and last token from its static
buffers and leaves the next step's there (``start + num_accepted + 1``, the
bonus token), so steps chain on the device with nothing from the host but
the block tables (blocks are reserved ahead of the rows). Launched as
separate pieces (three graphs and ~40 small kernels for positions, slots,
acceptance), such a step cost the host about as long as the GPU took to run
it; as one graph it is one launch.

The accepted rows' context is stored at the end of the same replay: the
acceptance counts are known on the device by then, and a rejected row's
slot becomes the reserved slot 0, as in a synchronous graphed step.

With prompt lookup on, each request's tokens live in a row of a device
buffer too (the host uploads what the row lacks when a chain starts; every
replay writes its accepted tokens), so a row whose suffix occurred before
drafts what followed it, by the synchronous steps' rule
(kernels/lookup.py), in place of the drafter's drafts.

Every placement runs this graph on rank 0 (step_parts.py): a drafter in
another process takes the propose and the context store into its own graph
(step_peers.py) and the two exchange the proposal and the acceptance inside
their replays; TP followers replay a graph of their verify shard, fed the
block's rows by a broadcast inside rank 0's.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from specray.actors.graphs import DecodeGraphs, peer_recv, peer_send
from specray.actors.step_parts import (
    StepSettings,
    bound_drafted,
    drafted_bounds,
    drafted_buffers,
    kept_rows,
    padding,
    propose,
    placeholder_drafted,
    sampling_tensors,
    state_buffers,
    unpack_drafted,
)
from specray.draft_tree import TreeUniverse, accept_greedy, kv_moves, path_tokens, target_choices
from specray.faults import DrafterLost, GroupLost, drafter_part
from specray.kernels.ops import accept_advance, argmax, block_inputs, move_kv
from specray.plan import AttentionMetadata
from specray.sampling import verify


def build_step_graphs(target, drafter, cfg: StepSettings, *, family: object, sampling: str = "greedy",
                      shared: dict[str, torch.Tensor] | None = None, tree: TreeUniverse | None = None,
                      remote=None, tp=None, speculate: bool = True, block_size: int | None = None,
                      context: bool = True) -> DecodeGraphs:
    """``DecodeGraphs`` of the whole step for ``target`` (rank 0's
    TargetWorker) and ``drafter`` (a DrafterWorker in this process, or None:
    autoregressive, or the drafter is ``remote``). Inputs: ``start`` and
    ``last`` (a first step only), ``real`` (1 for the batch's rows),
    ``target_tables`` / ``draft_tables`` ``[S, W]``, ``budget`` (a first
    step only: tokens each row may still emit; a block verifies at most
    ``budget - 1`` drafts, as a synchronous step cuts it), and with
    lookups (``cfg.lookup``; a local drafter) ``slot`` (a first step only:
    each row's row of the ``history`` buffer ``[max_seqs + 1, W]``, which
    the caller keeps filled with the rows' tokens; the last row takes the
    padding rows' writes). ``sampling``: "greedy" (every row), "sampled"
    (some rows sample; none filters by top-k / top-p) or "filtered"; the
    last two take ``temperature``, ``top_p``, ``top_k`` ``[S]`` and ``keys``
    ``[S, 3]`` (``sampling.seed_keys``) on a first step, and draw each
    step's uniforms from the rows' starts on the device. Lookups draft for
    greedy rows only. Output: ``[S, B + 2]`` rows of (num_accepted, bonus,
    drafted by lookup, B - 1 drafts).

    ``shared``: input buffers of the other sampling kinds' graphs, reused
    by name (one chain runs at a time, and a chain's first step uploads
    every input), so the token history and tables exist once.

    ``tree`` (a speculative engine's graphs, every sampling kind): blocks
    hold draft trees chosen from this universe (draft_tree.py) instead of
    chains, a greedy row's lookup draft a branch of its tree; sampled rows
    walk theirs with the target's samples (``target_choices``); the
    accepted nodes' target K/V move to their positions' slots in the same
    replay.

    ``remote``: the channel to a drafter in another process, which replays
    its half (step_peers.py) from the same inputs. ``tp``: a ``TPLink`` to
    the followers of a target at TP > 1.

    ``speculate=False``: an autoregressive step of a speculative engine
    (spec_policy.py): one row a request, no proposal, and the row's context
    stored (a remote drafter is sent the row, as after any step), so the
    next speculative step finds it; with ``context=False`` as well (a
    resting drafter, cluster/drafter_rest.py), the autoregressive engine's
    own step: no taps, no context store. ``block_size`` (no tree): a shorter
    chain than ``cfg``'s, the drafter's block of that many rows.
    ``family``: the capture stream's (``graphs.capture_stream``): each
    lane's graphs their own, apart from the target's."""
    assert context or (not speculate and remote is None), "only a local drafter rests, on autoregressive steps"
    dev = target.device
    local = drafter is not None
    speculative = local or remote is not None
    if not speculate:
        cfg = dataclasses.replace(cfg, block_size=1)
    elif block_size is not None:
        assert tree is None, "shorter chains are chains"
        cfg = dataclasses.replace(cfg, block_size=block_size)
    B = cfg.block_size
    oracle = getattr(drafter, "oracle", None) if local and speculate else None  # oracle.py
    if oracle is not None:
        oracle.prepare(dev, B - 1)
    bufs = state_buffers(cfg, dev, sampling, draft_tables=local, history=local and cfg.lookup is not None,
                         shared=shared, oracle=oracle is not None)
    query_start_loc = torch.arange(0, cfg.max_seqs * B + 1, B, dtype=torch.int64, device=dev)
    taps = target.tap_layer_ids if speculative and context else ()
    use_tree = tree is not None and speculative and speculate
    bounds = drafted_bounds(B, target.spec.vocab_size, use_tree, dev) if remote is not None else None

    @contextlib.contextmanager
    def remote_part(what: str):
        # TP followers replay this step too, waiting for rank 0's broadcast of
        # the block: a step cut here leaves them inside their replay, so the
        # group, not only the drafter, is lost.
        try:
            with drafter_part(what):
                yield
        except DrafterLost as e:
            if tp is None:
                raise
            raise GroupLost(f"{e}, while TP followers replayed the step") from e

    def step(n: int):
        start, last, real, budget = bufs["start"][:n], bufs["last"][:n], bufs["real"][:n], bufs["budget"][:n]
        tables = bufs["target_tables"][:n]
        d_tables = bufs["draft_tables"][:n] if local and context else None
        # A row within a block of its emit budget (max_tokens, max_model_len)
        # verifies a shorter block, which the drafter sees too (its block
        # attends both ways).
        blk = block_inputs(start, last, budget, tables, d_tables, B, cfg.kv_block_size, cfg.mask_token_id)
        st = sampling_tensors(bufs, sampling, n, start, B)
        if local and speculate:
            with drafter_part("propose"):
                drafted = propose(drafter, cfg, bufs, blk, st, n, sampling, tree if use_tree else None, oracle)
        elif remote is not None and speculate:
            got = drafted_buffers(n, B, use_tree, sampling != "greedy" and not use_tree, cfg.draft_top_k, dev)
            with remote_part("receiving its proposal"):
                peer_recv(remote, got, lambda ts: placeholder_drafted(ts, B))
            bound_drafted(got, bounds, target.spec.vocab_size)
            drafted = unpack_drafted(got, B)
        else:
            drafted = None
        positions, tree_mask = blk.positions, None
        if drafted is not None and drafted.shape is not None:
            positions = start[:, None] + drafted.row_offsets()
            tree_mask = drafted.shape.masks.reshape(-1)
        input_ids = drafted.input_ids if drafted is not None else last[:, None]
        if tp is not None:
            tp.send_verify(input_ids, positions, blk.target_slots, tree_mask, blk.seq_lens)
        attn = AttentionMetadata(positions.reshape(-1), blk.target_slots.reshape(-1), query_start_loc[: n + 1],
                                 blk.seq_lens, tables, B, target.max_model_len + 2 * B, tree_mask)
        logits, hidden_tapped = target.model.forward(input_ids.reshape(-1), attn, target.kv_cache,
                                                     logits_indices=slice(None), tap_layer_ids=taps)
        drafts = drafted.drafts if drafted is not None else input_ids[:, :0]
        looked_up = drafted.looked_up if drafted is not None else torch.zeros_like(real)
        row_kept = None
        if use_tree:
            # Sampled rows walk the tree with the target's samples (draft_tree.target_choices).
            choices = target_choices(logits.view(n, B, -1), drafted.shape, st, argmax(logits.view(n, B, -1)))
            acc = accept_greedy(choices, drafts, drafted.shape, blk.block_len - 1)
            src, dst = kv_moves(blk.target_slots, acc.path_rows)
            if tp is not None:
                tp.send_moves(src, dst)
            move_kv(target.kv_cache, src, dst)
            drafts, row_kept = path_tokens(drafts, acc.path_rows), acc.row_kept
            target_argmax, num_accepted, bonus = None, acc.num_accepted, acc.bonus
        elif sampling == "greedy":  # the acceptance is the argmax's: the glue kernel does it
            target_argmax, num_accepted, bonus = argmax(logits.view(n, B, -1)), None, None
        else:
            idx, q = (drafted.draft_idx, drafted.draft_q) if drafted is not None else (None, None)
            res = verify(logits.view(n, B, -1), drafts, blk.block_len - 1, st, idx, q)
            target_argmax, num_accepted, bonus = None, res.num_accepted, res.bonus
        history, history_rows = (bufs["history"], bufs["slot"][:n]) if "history" in bufs else (None, None)
        out, context_slots = accept_advance(target_argmax, num_accepted, bonus, drafts, blk.block_len, looked_up,
                                            blk.draft_slots, start, last, budget, real, history, history_rows)
        if local and context:
            if row_kept is not None:  # each kept row's context goes to its depth's slot
                context_slots = torch.where(row_kept, blk.draft_slots.gather(1, drafted.row_offsets()), 0)
            with drafter_part("its context store"):
                drafter.model.store_context(hidden_tapped, positions.reshape(-1), context_slots.reshape(-1),
                                            drafter.kv_cache)
        elif remote is not None:
            kept = kept_rows(out[:, 0], B, row_kept)
            with remote_part("sending it the acceptance"):
                peer_send(remote, [torch.cat([out, kept.long()], 1), hidden_tapped])
        return (out,)

    return DecodeGraphs(step, bufs, dict.fromkeys(bufs, 1), padding(bufs, sampling, cfg.max_seqs), cfg.max_seqs, dev,
                        family=family)

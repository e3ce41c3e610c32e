"""One CUDA graph for a whole decode step:
drafter propose, target verify, acceptance, drafter context store, and the
next step's inputs, with the target and the drafter in this process.

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
"""

from __future__ import annotations

import torch

from specray.actors.drafter import draft_tree_of
from specray.actors.graphs import DecodeGraphs
from specray.draft_tree import TreeUniverse, accept_greedy, kv_moves, path_tokens, row_depths
from specray.kernels.ops import accept_advance, argmax, block_inputs, lookup_drafts, move_kv
from specray.plan import AttentionMetadata
from specray.sampling import SamplingTensors, position_uniforms, sample_draft_tokens, verify


def build_step_graphs(target, drafter, block_size: int, max_seqs: int, kv_block_size: int,
                      mask_token_id: int | None, lookup: tuple[int, int] | None = None,
                      lookup_agree: bool = False, sampling: str = "greedy", draft_top_k: int = 64,
                      shared: dict[str, torch.Tensor] | None = None, tree: TreeUniverse | None = None) -> DecodeGraphs:
    """``DecodeGraphs`` of the whole step for ``target`` (a TargetWorker,
    TP 1) and ``drafter`` (a DrafterWorker or None). Inputs: ``start`` and
    ``last`` (a first step only), ``real`` (1 for the batch's rows),
    ``target_tables`` / ``draft_tables`` ``[S, W]``, ``budget`` (a first
    step only: tokens each row may still emit; a block verifies at most
    ``budget - 1`` drafts, as a synchronous step cuts it), and with ``lookup``
    (min_n, max_n; needs the drafter) ``slot`` (a first step only: each
    row's row of the ``history`` buffer ``[max_seqs + 1, W]``, which the
    caller keeps filled with the rows' tokens; the last row takes the
    padding rows' writes; ``lookup_agree``: a lookup is taken only where it
    opens with the drafter's first draft). ``sampling``: "greedy" (every row),
    "sampled" (some rows sample; none filters by top-k / top-p) or
    "filtered"; the last two take ``temperature``, ``top_p``, ``top_k``
    ``[S]`` and ``keys`` ``[S, 3]`` (``sampling.seed_keys``) on a first
    step, and draw each step's uniforms from the rows' starts on the
    device. Lookups draft for greedy rows only. Output: ``[S, B + 2]`` rows
    of (num_accepted, bonus, drafted by lookup, B - 1 drafts).

    ``shared``: input buffers of the other sampling kinds' graphs, reused
    by name (one chain runs at a time, and a chain's first step uploads
    every input), so the token history and tables exist once.

    ``tree`` (greedy graphs with a drafter): blocks hold draft trees chosen
    from this universe (draft_tree.py) instead of chains, a row's lookup
    draft a branch of its tree; the accepted nodes' target K/V move to their
    positions' slots in the same replay."""
    dev, B, G = target.device, block_size, block_size - 1
    width = -(-(target.max_model_len + 2 * B) // kv_block_size)
    bufs = {
        "start": torch.zeros(max_seqs, dtype=torch.int64, device=dev),
        "last": torch.zeros(max_seqs, dtype=torch.int64, device=dev),
        "real": torch.zeros(max_seqs, dtype=torch.bool, device=dev),
        "budget": torch.zeros(max_seqs, dtype=torch.int64, device=dev),
        "target_tables": torch.zeros(max_seqs, width, dtype=torch.int32, device=dev),
    }
    if drafter is not None:
        bufs["draft_tables"] = torch.zeros(max_seqs, width, dtype=torch.int32, device=dev)
    if drafter is not None and lookup:
        bufs["slot"] = torch.zeros(max_seqs, dtype=torch.int64, device=dev)
        bufs["history"] = torch.zeros(max_seqs + 1, width * kv_block_size, dtype=torch.int64, device=dev)
    if sampling != "greedy":
        bufs["temperature"] = torch.zeros(max_seqs, dtype=torch.float32, device=dev)
        bufs["top_p"] = torch.ones(max_seqs, dtype=torch.float32, device=dev)
        bufs["top_k"] = torch.zeros(max_seqs, dtype=torch.int64, device=dev)
        bufs["keys"] = torch.zeros(max_seqs, 3, dtype=torch.int64, device=dev)
    if shared is not None:
        bufs = {name: shared.setdefault(name, buf) for name, buf in bufs.items()}
    # Padding rows: block 0, positions from 0, their state reset every step.
    pad = dict.fromkeys(bufs, 0) | ({"top_p": 1} if sampling != "greedy" else {}) | ({"slot": max_seqs} if "slot" in bufs else {})
    no_drafts = torch.zeros(max_seqs, 0, dtype=torch.int64, device=dev)
    no_lookups = torch.zeros(max_seqs, dtype=torch.bool, device=dev)
    query_start_loc = torch.arange(0, max_seqs * B + 1, B, dtype=torch.int64, device=dev)
    greedy = SamplingTensors(temperature=torch.zeros(0), top_p=torch.zeros(0), top_k=torch.zeros(0, dtype=torch.int64),
                             uniforms=torch.zeros(3, 0, 0, dtype=torch.float64), all_greedy=True)
    taps = target.tap_layer_ids if drafter is not None else ()
    use_tree = tree is not None and drafter is not None and sampling == "greedy"

    def sampling_tensors(n: int, start: torch.Tensor) -> SamplingTensors:
        if sampling == "greedy":
            return greedy
        return SamplingTensors(bufs["temperature"][:n], bufs["top_p"][:n], bufs["top_k"][:n],
                               position_uniforms(bufs["keys"][:n].T, start, B), all_greedy=False,
                               any_filter=sampling == "filtered")

    def step(n: int):
        start, last, real, budget = bufs["start"][:n], bufs["last"][:n], bufs["real"][:n], bufs["budget"][:n]
        tables = bufs["target_tables"][:n]
        d_tables = bufs["draft_tables"][:n] if drafter is not None else None
        # A row within a block of its emit budget (max_tokens, max_model_len)
        # verifies a shorter block, which the drafter sees too (its block
        # attends both ways).
        blk = block_inputs(start, last, budget, tables, d_tables, B, kv_block_size, mask_token_id or 0)
        st = sampling_tensors(n, start)
        draft_idx = draft_q = history = history_rows = None
        positions, tree_mask, shape = blk.positions, None, None
        if drafter is not None:
            hidden = drafter.model.propose_hidden(blk.block_ids, start, blk.block_len, d_tables,
                                                  drafter.max_model_len, drafter.kv_cache, blk.positions)
            draft_logits = drafter.model.logits(hidden[:, 1:])
            if lookup:
                history, history_rows = bufs["history"], bufs["slot"][:n]
            if use_tree:
                looked_up, found = no_lookups[:n], None
                if lookup:  # a row's lookup draft joins its tree as a branch
                    _, found, looked_up = lookup_drafts(history, history_rows, blk.known_lens, blk.block_len, None,
                                                        torch.zeros_like(blk.block_ids[:, 1:]), last, lookup[0],
                                                        lookup[1])
                drafts, shape = draft_tree_of(draft_logits, tree, found, looked_up if lookup else None)
                input_ids = torch.cat([last[:, None], drafts], 1)
                positions = start[:, None] + row_depths(shape)
                tree_mask = shape.masks.reshape(-1)
            else:
                drafts, draft_idx, draft_q = sample_draft_tokens(draft_logits, st, draft_top_k)
                if lookup:
                    greedy_rows = None if sampling == "greedy" else st.temperature == 0
                    input_ids, drafts, looked_up = lookup_drafts(history, history_rows, blk.known_lens,
                                                                 blk.block_len, greedy_rows, drafts, last, lookup[0],
                                                                 lookup[1], lookup_agree)
                else:
                    input_ids, looked_up = torch.cat([last[:, None], drafts], 1), no_lookups[:n]
        else:
            drafts, looked_up = no_drafts[:n], no_lookups[:n]
            input_ids = last[:, None]
        attn = AttentionMetadata(positions.reshape(-1), blk.target_slots.reshape(-1), query_start_loc[: n + 1],
                                 blk.seq_lens, tables, B, target.max_model_len + 2 * B, tree_mask)
        logits, hidden_tapped = target.model.forward(input_ids.reshape(-1), attn, target.kv_cache,
                                                     logits_indices=slice(None), tap_layer_ids=taps)
        tree_slots = None
        if use_tree:
            acc = accept_greedy(argmax(logits.view(n, B, -1)), drafts, shape, blk.block_len - 1)
            move_kv(target.kv_cache, *kv_moves(blk.target_slots, acc.path_rows))
            # Each kept row's context goes to its depth's slot.
            tree_slots = torch.where(acc.row_kept, blk.draft_slots.gather(1, row_depths(shape)), 0)
            drafts = path_tokens(drafts, acc.path_rows)
            target_argmax, num_accepted, bonus = None, acc.num_accepted, acc.bonus
        elif sampling == "greedy":  # the acceptance is the argmax's: the glue kernel does it
            target_argmax, num_accepted, bonus = argmax(logits.view(n, B, -1)), None, None
        else:
            res = verify(logits.view(n, B, -1), drafts, blk.block_len - 1, st, draft_idx, draft_q)
            target_argmax, num_accepted, bonus = None, res.num_accepted, res.bonus
        out, context_slots = accept_advance(target_argmax, num_accepted, bonus, drafts, blk.block_len, looked_up,
                                            blk.draft_slots, start, last, budget, real, history, history_rows)
        if drafter is not None:
            if tree_slots is not None:
                context_slots = tree_slots
            drafter.model.store_context(hidden_tapped, positions.reshape(-1), context_slots.reshape(-1),
                                        drafter.kv_cache)
        return (out,)

    return DecodeGraphs(step, bufs, dict.fromkeys(bufs, 1), pad, max_seqs, dev)

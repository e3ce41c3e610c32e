"""What a synchronous step hands the workers: the target's flattened
verify blocks and prefill chunks, the drafter's blocks, prompt-lookup
drafts, and a draft tree's positions and masks."""

from __future__ import annotations

import torch

from specray.actors.kv_cache import block_table_tensor
from specray.plan import AttentionMetadata, DraftBatch, TargetBatch
from specray.prompt_lookup import NgramIndex, lookup_rows
from specray.sampling import SamplingTensors
from specray.scheduler import DecodeItem, PrefillItem
from specray.staging import host_to_device, int64_tensor


class StepBatches:
    """``EngineCore``'s batch building for synchronous steps."""

    def _tree_step(self, decode: list[DecodeItem]) -> bool:
        """Whether this step's blocks hold draft trees (greedy and sampled
        rows alike): none needing what walks a chain's rows (min_tokens'
        mask, log probabilities, penalties)."""
        return self.tree is not None and not any(d.request.reads_verify_rows for d in decode)

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
        block_ids[:, 0] = torch.tensor([d.request.last_token_id for d in decode])
        ctx = [d.request.num_computed for d in decode]
        return DraftBatch(
            block_ids=block_ids,
            ctx_lens=int64_tensor(ctx),
            block_lens=torch.tensor([d.block_len for d in decode], dtype=torch.int64),
            block_tables=block_table_tensor([d.request.draft_blocks.blocks for d in decode]),
            max_ctx_len=max(ctx),
            sampling=st,
            tree=tree_lookup is not None,
            tree_lookup=lookup,
            tree_has_lookup=has,
            requests=[d.request for d in decode] if getattr(self.drafter, "wants_requests", False) else None,
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
            ids.append(r.last_token_id)
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
            positions=int64_tensor(positions),
            slot_mapping=int64_tensor(slots),
            query_start_loc=int64_tensor(starts),
            seq_lens=int64_tensor(seq_lens),
            block_tables=block_table_tensor(tables),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        batch = TargetBatch(
            input_ids=int64_tensor(ids),
            attn=attn,
            logits_indices=int64_tensor(logits_indices),
            want_hidden=self.drafter is not None,
            uniform_rows=self.block_size if uniform else 0,
        )
        logit_rows = (int64_tensor(verify_rows), int64_tensor(sample_rows))
        return batch, int64_tensor(draft_dst), int64_tensor(draft_src), logit_rows

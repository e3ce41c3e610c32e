"""Asynchronous decode steps: step n+1 is launched from step n's results on
the device, before the host has read them.

A synchronous step leaves the GPU idle while the host builds the next
batch, launches it and, after the one sync, applies the tokens (detokenize,
stop checks, bookkeeping). For a decode-only greedy batch of full verify
blocks nothing in step n+1's inputs needs the host: each row's block
starts at ``start + num_accepted + 1`` and opens with the bonus token, and
the positions, slots (from block tables reserved two blocks ahead) and
sequence lengths follow on the device. So the engine enqueues step n+1
(one graph replay: propose, verify, accept, context store;
actors/step_graph.py) and only then waits for step n's results, which it
applies while the GPU runs step n+1.

Tokens do not change: every row still emits exactly what the synchronous
step would (greedy verification keeps the target's argmax chain, whatever
the drafts). A row whose request finishes while its next step is in flight
has that step's results dropped. The engine drains back to synchronous
steps whenever the set of rows must change (a finish, an admission that
fits, a sampled request, a length limit within two blocks, no room to
reserve) —
and prompt-lookup drafts, which need the host's tokens, sit these steps out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.actors.kv_cache import block_table_tensor
from specray.request import Request


@dataclass
class InflightStep:
    """A launched decode step whose results the host has not read."""

    requests: list[Request]
    results: torch.Tensor  # [S, B + 1] int64 on the host: accepted, bonus, drafts
    ready: torch.cuda.Event | None  # recorded after the copy into ``results``

    def read(self) -> tuple[list[int], list[int], list[list[int]]]:
        if self.ready is not None:
            self.ready.synchronize()
        rows = self.results.tolist()
        return [r[0] for r in rows], [r[1] for r in rows], [r[2:] for r in rows]


def launch_decode(core, requests: list[Request], chained: bool) -> InflightStep:
    """Enqueue one step graph replay (actors/step_graph.py) for
    ``requests``: a first step loads each row's start and last token from
    the host, a chained one continues from the previous replay's. Blocks
    must be reserved through ``start + B`` positions."""
    graphs = core.step_graphs()
    dev = core.device
    inputs = {}
    if not chained:
        inputs["start"] = torch.tensor([r.num_computed for r in requests], dtype=torch.int64)
        inputs["last"] = torch.tensor([r.output_token_ids[-1] for r in requests], dtype=torch.int64)
        inputs["real"] = torch.ones(len(requests), dtype=torch.bool)
    # Tables change only when a row crosses into a new block: upload them then.
    tables = [r.target_blocks.blocks for r in requests]
    if not chained or tables != core.uploaded_tables:
        inputs["target_tables"] = block_table_tensor(tables)
        if core.drafter is not None:
            inputs["draft_tables"] = block_table_tensor([r.draft_blocks.blocks for r in requests])
        core.uploaded_tables = [list(t) for t in tables]
    if dev.type == "cuda":
        inputs = {k: v.pin_memory() for k, v in inputs.items()}
    (out,) = graphs.run(len(requests), inputs)
    out = out[: len(requests)]
    if dev.type == "cuda":
        results = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        results.copy_(out, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        results, ready = out.clone(), None
    return InflightStep(list(requests), results, ready)

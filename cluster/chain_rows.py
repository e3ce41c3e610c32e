"""The state each row of a chain of asynchronous steps starts from
(async_decode.py): at a chain's first step every row's, from the host
(start, last token, emit budget, sampling settings, token history); when a
request joins a running chain (chain_admit.py) its row's alone, written in
place into the step graphs' buffers, where the other rows' state is the
device's own and must not be overwritten."""

from __future__ import annotations

import torch

from specray.request import Request
from specray.sampling import any_filter, seed_keys
from specray.staging import host_to_device


# The token history's rows a first step uploads (hist rows, columns, tokens),
# by name where they travel to a drafter in another process.
HISTORY_UPLOADS = ("history_rows", "history_cols", "history_tokens")


def batch_mode(requests: list[Request], vocab_size: int) -> str:
    """The sampling kind of a batch, whose step graphs it runs."""
    params = [r.params for r in requests]
    return "greedy" if all(p.greedy for p in params) else "filtered" if any_filter(params, vocab_size) else "sampled"


def first_inputs(core, requests: list[Request], first_tokens: torch.Tensor | None, mode: str, graphs) -> tuple:
    """Each row's state for its first step of a chain, ``[S]`` host tensors
    by buffer name (``last`` the device's ``first_tokens`` after a prefill),
    and the token history's uploads (or None)."""
    inputs, uploads = {}, None
    after_prefill = first_tokens is not None
    starts = [r.num_tokens if after_prefill else r.num_computed for r in requests]
    inputs["start"] = torch.tensor(starts, dtype=torch.int64)
    inputs["last"] = first_tokens if after_prefill else \
        torch.tensor([r.output_token_ids[-1] for r in requests], dtype=torch.int64)
    inputs["real"] = torch.ones(len(requests), dtype=torch.bool)
    # Both bounds of the scheduler's (max_tokens, max_model_len) fall by
    # the tokens each step emits, so the device keeps it exact.
    budgets = [core.scheduler.emit_budget(r) - after_prefill for r in requests]
    inputs["budget"] = torch.tensor(budgets)
    kv = core.config.kv_block_size
    for r, start, budget in zip(requests, starts, budgets):
        # Unreserved rows would write their K/V into block 0 and read back nothing.
        if len(r.target_blocks.blocks) * kv < start + min(core.block_size, budget):
            raise RuntimeError(f"request {r.request_id}: blocks not reserved through its first step's block")
    if mode != "greedy":  # the graphs draw each step's uniforms from the keys (SamplingTensors' settings)
        params = [r.params for r in requests]
        inputs |= {"temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
                   "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
                   "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
                   "keys": torch.from_numpy(seed_keys([r.seed for r in requests])).T.contiguous()}
    if "oracle_seq" in graphs.buffers:  # oracle acceptance (oracle.py)
        inputs |= core.oracle.chain_inputs(requests, starts)
    if "history" in graphs.buffers or (core.drafter is not None and core.config.prompt_lookup_min):
        inputs["slot"], uploads = core.history_slots.prepare(requests, core.scheduler.running)
    return inputs, uploads


def write_history(graphs, inputs: dict, uploads, first_tokens: torch.Tensor | None) -> None:
    """Bring the token history's rows up to the host's tokens (and, after a
    prefill, the first tokens after the prompts)."""
    dev = graphs.device
    history = graphs.buffers["history"]
    if uploads.shape[1]:  # none where no row looks up (sampled rows)
        hist_rows, cols, tokens = host_to_device(uploads, dev)
        history.index_put_((hist_rows, cols), tokens)
    if first_tokens is not None:
        hist_rows, cols = host_to_device(torch.stack([inputs["slot"], inputs["start"]]), dev)
        history.index_put_((hist_rows, cols), first_tokens.to(history.dtype))


def join_rows(core, graphs, requests: list[Request], joined: tuple[int, ...], first_tokens: torch.Tensor,
              mode: str, drafter_apart: bool = False) -> dict:
    """Write the first-step state of the rows ``joined`` (their requests'
    prompts just prefilled, ``first_tokens`` ``[len(joined)]`` on the device)
    into ``graphs``' buffers. Finished rows riding along are pointed at the
    history's padding row: theirs may be a joining request's now. Returns,
    for a drafter in another process (``drafter_apart``), the same state as
    a JOINED word's inputs (``step_peers.apply_join``); else nothing."""
    joining = [requests[i] for i in joined]
    inputs, uploads = first_inputs(core, joining, first_tokens, mode, graphs)
    riding = [i for i, r in enumerate(requests) if r.finished] if uploads is not None else []
    # One copy up: the rows' indices, their integer and their float state.
    names = [n for n in inputs if n in graphs.buffers and n not in ("real", "last")]
    for n in names:  # a row narrower than its buffer (oracle.py's recorded sequences) is zero-padded
        width = graphs.buffers[n].shape[1] if graphs.buffers[n].dim() == 2 else 0
        if inputs[n].dim() == 2 and inputs[n].shape[1] < width:
            inputs[n] = torch.nn.functional.pad(inputs[n], (0, width - inputs[n].shape[1]))
    ints = [n for n in names if not inputs[n].is_floating_point()]
    floats = [n for n in names if inputs[n].is_floating_point()]
    k = len(joined)
    packed = torch.cat([torch.tensor(list(joined) + riding, dtype=torch.int64)] +
                       [inputs[n].reshape(k, -1).T.reshape(-1) for n in ints])
    dev = graphs.device
    packed = host_to_device(packed, dev)
    float_rows = host_to_device(torch.stack([inputs[n] for n in floats]), dev) if floats else None
    idx, at = packed[:k], k + len(riding)
    for n in ints:
        buf = graphs.buffers[n]
        width = inputs[n].reshape(k, -1).shape[1]
        buf.index_copy_(0, idx, packed[at : at + k * width].view(width, k).T.reshape(buf[:k].shape).to(buf.dtype))
        at += k * width
    for j, n in enumerate(floats):
        graphs.buffers[n].index_copy_(0, idx, float_rows[j])
    graphs.buffers["last"].index_copy_(0, idx, first_tokens.to(graphs.buffers["last"].dtype))
    if uploads is not None and "history" in graphs.buffers:
        write_history(graphs, inputs, uploads, first_tokens)
        if riding:
            padding_row = graphs.buffers["history"].shape[0] - 1
            graphs.buffers["slot"].index_fill_(0, packed[k : k + len(riding)], padding_row)
    if not drafter_apart:
        return {}
    peer = {"join_rows": torch.tensor(joined, dtype=torch.int64), "join_first": first_tokens.to(torch.int64)}
    peer |= {"join_" + n: inputs[n] for n in ("start", "budget", "temperature", "top_p", "top_k", "keys", "slot")
             if n in inputs}
    if riding:
        peer["join_riding"] = torch.tensor(riding, dtype=torch.int64)
    if uploads is not None and "history" not in graphs.buffers:  # the drafter's process keeps the history
        peer |= dict(zip(HISTORY_UPLOADS, uploads))
    return peer

"""Bulk self-distillation data: the target answers many prompts at once,
on specray's own target worker, with decode steps replayed from CUDA graphs.

HF ``generate`` reached ~10 k tok/s for SmolLM2-135M at batch 1024 on the
H200 (a growing cache and a host-driven step). Here a static batch of up to
``batch_size`` sequences owns fixed KV blocks, every decode step is one graph
replay plus a few tensor ops, and nothing returns to the host until the
batch is done, so the step costs what the GPU work costs. Greedy tokens are
the ones specray's own autoregressive engine produces (same model code,
same kernels, same logits).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specray.actors.target import TargetWorker
from specray.config import TargetSpec
from specray.plan import AttentionMetadata, TargetBatch
from specray.sampling import SamplingParams, SamplingTensors, filtered_probs
from specray.training.progress import bar

KV_BLOCK = 16


def _sample(logits: torch.Tensor, st: SamplingTensors, gen: torch.Generator | None) -> torch.Tensor:
    """Next token per row of ``logits`` ``[n, V]``: the engine's filtered
    distribution, drawn with ``gen`` (the data needs no counter-based RNG)."""
    if st.all_greedy:
        return logits.argmax(-1)
    return torch.multinomial(filtered_probs(logits, st), 1, generator=gen).squeeze(-1)


class BulkGenerator:
    """Static-batch generation on one ``TargetWorker``."""

    def __init__(self, target_dir: str, *, max_prompt_len: int, max_new_tokens: int, batch_size: int,
                 device: str, dtype: str, prefill_tokens: int = 32768):
        self.spec = TargetSpec.from_dir(target_dir)
        self.max_prompt_len, self.max_new = max_prompt_len, max_new_tokens
        self.max_len = max_prompt_len + max_new_tokens
        self.batch_size = batch_size
        self.prefill_tokens = prefill_tokens
        self.worker = TargetWorker(self.spec, device=device, dtype=dtype, max_model_len=self.max_len)
        self.device = self.worker.device
        self.blocks_per_seq = -(-self.max_len // KV_BLOCK)
        # Block 0 stays reserved for the padded rows of a captured batch.
        self.worker.init_cache(1 + batch_size * self.blocks_per_seq, KV_BLOCK)
        self.worker.enable_decode_graphs(1, batch_size, KV_BLOCK, want_hidden=False)

    def _tables(self, n: int) -> torch.Tensor:
        first = 1 + torch.arange(n, device=self.device)[:, None] * self.blocks_per_seq
        return (first + torch.arange(self.blocks_per_seq, device=self.device)[None]).to(torch.int32)

    def _slots(self, tables: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return tables[rows, pos // KV_BLOCK].long() * KV_BLOCK + pos % KV_BLOCK

    def _prefill(self, prompts: list[list[int]], tables: torch.Tensor) -> torch.Tensor:
        """Writes the prompts' KV; returns the last row's logits ``[n, V]``."""
        out = []
        i = 0
        while i < len(prompts):
            j, tokens = i, 0
            while j < len(prompts) and (j == i or tokens + len(prompts[j]) <= self.prefill_tokens):
                tokens += len(prompts[j])
                j += 1
            chunk = prompts[i:j]
            lens = torch.tensor([len(p) for p in chunk], device=self.device)
            starts = torch.cumsum(lens, 0) - lens
            seq = torch.repeat_interleave(torch.arange(len(chunk), device=self.device), lens)
            pos = torch.arange(tokens, device=self.device) - starts[seq]
            attn = AttentionMetadata(
                positions=pos,
                slot_mapping=self._slots(tables, seq + i, pos),
                query_start_loc=torch.cat([starts, starts[-1:] + lens[-1:]]),
                seq_lens=lens,
                block_tables=tables[i:j],
                max_query_len=int(lens.max()),
                max_seq_len=int(lens.max()),
            )
            ids = torch.tensor([t for p in chunk for t in p], dtype=torch.int64, device=self.device)
            batch = TargetBatch(ids, attn, logits_indices=starts + lens - 1, want_hidden=False)
            out.append(self.worker.execute(batch))
            i = j
        return torch.cat(out)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float, stop_ids: list[int],
                 gen: torch.Generator | None = None) -> list[list[int]]:
        """Generated ids for each prompt (``len(prompts) <= batch_size``),
        cut after the first stop id, at most ``max_new_tokens``."""
        n = len(prompts)
        assert 0 < n <= self.batch_size
        too_long = [len(p) for p in prompts if not 0 < len(p) <= self.max_prompt_len]
        if too_long:
            raise ValueError(f"prompt lengths {too_long[:5]} outside 1..{self.max_prompt_len}")
        dev = self.device
        tables = self._tables(n)
        rows = torch.arange(n, device=dev)
        stop = torch.tensor(stop_ids, device=dev)
        st = SamplingTensors.build([SamplingParams(temperature=temperature, top_p=top_p)] * n, [0] * n, [0] * n, 0, dev)
        tok = _sample(self._prefill(prompts, tables), st, gen)
        pos = torch.tensor([len(p) for p in prompts], device=dev)
        out = torch.empty(n, self.max_new, dtype=torch.int64, device=dev)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        steps = 0
        for t in range(self.max_new):
            out[:, t] = tok
            done |= torch.isin(tok, stop)
            steps = t + 1
            if steps == self.max_new or (steps % 16 == 0 and bool(done.all())):
                break
            # Finished rows keep running (their writes stay in their own
            # blocks) so that the batch shape, and the graph, stay fixed.
            pos_c = pos.clamp(max=self.max_len - 1)
            (logits, _) = self.worker.graphs.run(n, {
                "input_ids": tok, "positions": pos_c, "slot_mapping": self._slots(tables, rows, pos_c),
                "seq_lens": pos_c + 1, "block_tables": tables,
            })
            tok = _sample(logits[:n], st, gen)
            pos = pos + 1
        out = out[:, :steps].cpu()
        hit = torch.isin(out, stop.cpu())
        lens = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full((n,), steps))
        return [out[r, : lens[r]].tolist() for r in range(n)]

    def generate_all(self, prompts: list[list[int]], *, temperature: float, top_p: float, stop_ids: list[int],
                     seed: int, time_budget_s: float, log: Callable[[str], None]) -> list[list[int]]:
        """All prompts in static batches; stops starting batches once the
        next would likely overrun ``time_budget_s`` (the answers so far are
        returned: callers keep the prompts they got answers for)."""
        gen = torch.Generator(device=self.device).manual_seed(seed) if temperature > 0 else None
        outs: list[list[int]] = []
        t0, last = time.time(), 0.0
        with bar(total=len(prompts), unit="prompt", desc=f"generate T={temperature}") as progress:
            for i in range(0, len(prompts), self.batch_size):
                if i and time.time() - t0 + last > time_budget_s:
                    log(f"gen: time budget {time_budget_s:.0f}s reached after {i}/{len(prompts)} prompts")
                    break
                tb = time.time()
                chunk = prompts[i : i + self.batch_size]
                res = self.generate(chunk, temperature=temperature, top_p=top_p, stop_ids=stop_ids, gen=gen)
                last = time.time() - tb
                outs += res
                progress.update(len(chunk))
                toks = sum(map(len, res))
                log(f"gen: {i + len(chunk)}/{len(prompts)} prompts, batch of {len(chunk)}: {toks} tokens in "
                    f"{last:.1f}s = {toks / max(last, 1e-9):.0f} tok/s (T={temperature})")
        return outs


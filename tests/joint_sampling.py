"""The seeded-sampling harness of the exactness tests: many short sampled
requests through the speculative engine on a tiny target, their token
triples counted against the target's own probabilities of them."""

import numpy as np
import torch
from scipy.stats import chisquare

from factories import make_drafter, make_target
from specray import SamplingParams
from specray.config import EngineConfig
from specray.llm import build_engine

V = 8  # vocabulary: V**3 triples, each seen often in 20k samples


def chi2_p(counts, probs):
    probs = np.asarray(probs, dtype=np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return chisquare(counts[keep], expected).pvalue


def pooled_chi2_p(counts, probs, min_expected=5.0):
    """Chi-square p-value with the cells expected under ``min_expected``
    pooled into one: the statistic's approximation needs a handful per cell,
    and one draw in a cell expected 0.01 times adds ~100 to it (exact
    autoregressive sampling of the 512 triples, seeds 0..19999, scores
    p = 1e-9 unpooled, 0.55 pooled)."""
    counts, probs = np.asarray(counts, dtype=np.float64), np.asarray(probs, dtype=np.float64)
    assert counts[probs <= 0].sum() == 0, "drew a token of probability 0"
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    obs, exp = np.append(counts[~small], counts[small].sum()), np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep]).pvalue


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], pen: dict) -> torch.Tensor:
    """vLLM's penalties on one row of logits, element by element."""
    out = logits.clone()
    for t in range(out.shape[-1]):
        c = output.count(t)
        if t in prompt or c:
            r = pen.get("repetition_penalty", 1.0)
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= pen.get("frequency_penalty", 0.0) * c + pen.get("presence_penalty", 0.0) * (c > 0)
    return out


def sampled_triples(root, prompt: list[int], n: int, temperature: float = 0.9, penalties: dict | None = None,
                    **engine_kw):
    """``n`` seeded requests of 3 tokens at ``temperature`` (with
    ``penalties``: SamplingParams' penalty fields) through a speculative
    engine (checkpoints written under ``root``; ``engine_kw`` extends its
    EngineConfig). Returns the finished outputs, the counts of the ``V**3``
    token triples and the target's probabilities of them."""
    hf = make_target(root / "t", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     head_dim=8, init_std=0.3, eos_token_id=None)
    make_drafter(root / "d", hf.config, num_layers=1, block_size=4, target_layer_ids=(0,), mask_token_id=7)
    cfg = EngineConfig(target=str(root / "t"), drafter=str(root / "d"), max_model_len=16, max_num_seqs=4096,
                       max_num_batched_tokens=16384, num_kv_blocks=4096 * 2, kv_block_size=4, **engine_kw)
    engine = build_engine(cfg)
    for i in range(n):
        engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=temperature, seed=i, **(penalties or {})),
                           request_id=str(i))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    with torch.no_grad():
        grid = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        logits = hf(grid).logits[:, -3:]  # rows for t1, t2, t3
        if penalties:
            for g in range(V * V):
                a, b = divmod(g, V)
                for k, output in enumerate(([], [a], [a, b])):
                    logits[g, k] = penalised(logits[g, k], prompt, output, penalties)
        logp = torch.log_softmax(logits / temperature, -1)
    p1 = logp[0, 0].exp()
    p2 = logp[::V, 1].exp()  # [a] -> dist of t2
    p3 = logp[:, 2].exp().view(V, V, V)  # [a, b] -> dist of t3
    joint = p1[:, None, None] * p2[:, :, None] * p3
    cells = np.zeros(V**3)
    for o in outs:
        if len(o.token_ids) == 3:
            a, b, c = o.token_ids
            cells[(a * V + b) * V + c] += 1
    return outs, cells, joint.reshape(-1).numpy()

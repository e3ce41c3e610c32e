"""Self-distillation data: the target writes the answers. With ``--magpie
N`` it first writes N user messages itself (Magpie, Xu et al. 2024, arXiv
2406.08464: given only the chat template up to a user turn, after a system
prompt from ``--magpie-systems`` that steers the topic, an instruction-tuned
model writes a plausible user message); then it answers those and the
files' prompts (greedy unless ``--temperature`` > 0), and the
``--sampled-prompts`` again ``--sampled-answers`` times at
``--sampled-temperature``, all on ``generator.BulkGenerator``."""

from __future__ import annotations

import json
from pathlib import Path
import random
import time

import torch

from specray.training.generator import BulkGenerator
from specray.training.progress import log
from specray.training.prompts import chat_ids, eval_index, load_prompts, magpie_prefixes


def generate_data(args, tok, eos: list[int], device) -> dict:
    """Prompts (the file's, plus ``--magpie`` user messages the target writes
    itself) answered by the target, on specray's bulk generator."""
    t_start = time.time()
    file_prompts = [chat_ids(tok, m) for m in load_prompts(args.prompts, args.num_prompts)]
    prefixes = magpie_prefixes(tok, args.magpie, args.magpie_systems, args.seed) if args.magpie else []
    longest_prefix = max(map(len, prefixes), default=0)
    max_prompt = max([len(p) for p in file_prompts] + [longest_prefix + args.magpie_max_tokens + 16])
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    gen = BulkGenerator(str(args.target), max_prompt_len=max_prompt,
                        max_new_tokens=max(args.max_new_tokens, args.magpie_max_tokens),
                        batch_size=args.gen_batch_size, device=str(device), dtype=dtype)
    budget = args.gen_time_budget_s
    magpie = []
    if args.magpie:
        t = time.time()
        gen.max_new = args.magpie_max_tokens
        raw = gen.generate_all(prefixes, temperature=args.magpie_temperature, top_p=args.magpie_top_p,
                               stop_ids=eos, seed=args.seed, time_budget_s=budget * args.magpie_budget_frac, log=log)
        held_out = eval_index(args.exclude_prompts)
        seen, near_eval, texts = set(), 0, []
        for ids in raw:  # a complete, non-trivial, new message, not near an eval prompt
            if len(ids) < 4 or ids[-1] not in eos:
                continue
            text = tok.decode(ids[:-1], skip_special_tokens=True).strip()
            if len(text) < 8 or text in seen:
                continue
            seen.add(text)
            if held_out is not None and held_out.near(text):
                near_eval += 1
                continue
            texts.append(text)
            magpie.append(chat_ids(tok, [{"role": "user", "content": text}]))
        with open(Path(args.out) / "magpie_prompts.jsonl", "w") as f:
            f.writelines(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts)
        log(f"magpie: {len(magpie)} usable user messages of {len(raw)} sampled in {time.time() - t:.1f}s "
            f"({near_eval} dropped as near-duplicates of {', '.join(args.exclude_prompts) or 'no held-out set'})")
    prompts = [p for p in file_prompts + magpie if len(p) <= max_prompt]
    random.Random(args.seed).shuffle(prompts)
    gen.max_new = args.max_new_tokens
    spent = time.time() - t_start
    answers = gen.generate_all(prompts, temperature=args.temperature, top_p=args.top_p, stop_ids=eos,
                               seed=args.seed + 1, time_budget_s=max(budget - spent, 1.0), log=log)
    if args.sampled_answers and args.sampled_prompts:
        # More answers to the prompts nearest real use, sampled: the drafter
        # also sees the target continue from contexts off its greedy path.
        extra = [chat_ids(tok, m) for m in load_prompts(args.sampled_prompts, 0)] * args.sampled_answers
        extra = [p for p in extra if len(p) <= max_prompt]
        spent = time.time() - t_start
        extra_answers = gen.generate_all(extra, temperature=args.sampled_temperature, top_p=args.sampled_top_p,
                                         stop_ids=eos, seed=args.seed + 2, time_budget_s=max(budget - spent, 1.0),
                                         log=log)
        pairs = list(zip(prompts + extra, answers + extra_answers))
        random.Random(args.seed + 3).shuffle(pairs)  # --max-train-tokens takes a prefix: mix the two kinds
        prompts, answers = [p for p, _ in pairs], [a for _, a in pairs]
        log(f"sampled: {len(extra_answers)} answers at T={args.sampled_temperature} to "
            f"{len(extra) // args.sampled_answers} prompts")
    del gen
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seqs, prompt_lens, n_gen, n_eos = [], [], 0, 0
    for p, a in zip(prompts, answers):
        seqs.append(torch.tensor(p + a, dtype=torch.int32))
        prompt_lens.append(len(p))
        n_gen += len(a)
        n_eos += bool(a) and a[-1] in eos
    gen_s = time.time() - t_start
    meta = dict(
        prompts_file=args.prompts, target=str(args.target), file_prompts=len(file_prompts),
        sampled_prompts=args.sampled_prompts, sampled_answers=args.sampled_answers,
        sampled_temperature=args.sampled_temperature, sampled_top_p=args.sampled_top_p,
        magpie_sampled=args.magpie, magpie_kept=len(magpie), magpie_temperature=args.magpie_temperature,
        magpie_top_p=args.magpie_top_p, magpie_systems=args.magpie_systems,
        magpie_excluded_near=args.exclude_prompts, num_prompts=len(seqs), max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, gen_batch_size=args.gen_batch_size,
        gen_seconds=round(gen_s, 2), generated_tokens=n_gen, gen_tokens_per_s=round(n_gen / max(gen_s, 1e-9), 1),
        frac_with_eos=round(n_eos / max(len(seqs), 1), 4),
        generator="specray BulkGenerator (specray.training.generator)",
    )
    log(f"gen: {len(seqs)} responses, {n_gen} tokens in {gen_s:.1f}s ({meta['gen_tokens_per_s']:.0f} tok/s), "
        f"{100 * meta['frac_with_eos']:.0f}% ended with EOS")
    return dict(tokens=torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.int32),
                lengths=torch.tensor([len(s) for s in seqs], dtype=torch.long),
                prompt_lens=torch.tensor(prompt_lens, dtype=torch.long), meta=meta)


def load_or_generate(args, tok, eos: list[int], device, out: Path) -> dict:
    """OUT/data.pt, generated once: a rerun (or a resumed run) trains on the
    same token sequences without regenerating them."""
    cache = out / "data.pt"
    if cache.is_file() and not args.regen:
        data = torch.load(cache)
        log(f"data: reusing {cache} ({len(data['lengths'])} sequences, generated with "
            f"{data['meta']['max_new_tokens']} new tokens, temperature {data['meta']['temperature']})")
        return data
    data = generate_data(args, tok, eos, device)
    torch.save(data, cache)
    return data

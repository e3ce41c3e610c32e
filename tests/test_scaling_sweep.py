"""examples/scaling_sweep.py on the CPU: random checkpoints written from the
shapes load in specray, and a small sweep over the Ray backend produces its
points (the multi-GPU issue runs the real one)."""

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("scaling_sweep", ROOT / "examples" / "scaling_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_random_checkpoints_load_and_fit(tmp_path):
    from specray import LLM, SamplingParams

    sw = load()
    target, drafter = sw.random_checkpoints(tmp_path, "tiny")
    out = LLM(target, drafter).generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 5
    # the target's greedy continuation is its permutation: what oracle acceptance records and verifies
    perm = torch.load(Path(target) / "greedy_next.pt").tolist()
    tokens = [3] + out[0].token_ids
    assert tokens[1:] == [perm[t] for t in tokens[:-1]]
    assert sw.random_checkpoints(tmp_path, "tiny") == (target, drafter)  # written once
    assert sw.gpus_needed(2, "separate", 2) == 6 and sw.gpus_needed(2, "colocated", 1) == 2


def test_sweep_on_cpu_ray(tmp_path):
    sw = load()
    out = tmp_path / "sweep.json"
    report = sw.main(["--shape", "tiny", "--ckpt-dir", str(tmp_path / "ck"), "--device", "cpu", "--tp", "1",
                      "--placement", "separate", "--replicas", "1", "--concurrency", "1", "2",
                      "--max-tokens", "4", "--max-model-len", "128", "--cuda-graphs", "--out", str(out)])
    points = report["points"]
    assert [(p["mode"], p["concurrency"]) for p in points] == [("spec", 1), ("spec", 2), ("ar", 1), ("ar", 2)]
    assert all(p["cuda_graphs"] for p in points)  # the graph layout (eager off CUDA), warmed per batch size
    assert all(p["tokens"] == 4 * p["concurrency"] and p["tokens_per_s"] > 0 for p in points)
    assert json.loads(out.read_text())["points"] == points
    import ray

    assert not ray.is_initialized()  # the sweep stops the Ray it started

"""bench/step_phases.py on a tiny random target and drafter (CPU): the
phases it times are the step's, and they add up to no more than the step."""

import sys
from pathlib import Path

from factories import add_tokenizer, make_drafter, make_target
from specray import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_phases  # noqa: E402


def test_phases_of_a_step(tmp_path):
    hf = make_target(tmp_path / "t", seed=4)
    add_tokenizer(tmp_path / "t", hf.config.vocab_size)
    make_drafter(tmp_path / "d", hf.config)
    for drafter, expect in ((tmp_path / "d", {"lookup", "draft batch", "propose (launch + draft argmax)"}),
                            (None, set())):
        llm = LLM(tmp_path / "t", drafter, cuda_graphs=True, max_model_len=256)
        r = step_phases.time_phases(llm, "The capital of France is", steps=6)
        phases = set(r["phases_ms"])
        assert {"schedule", "target batch", "target execute (launch)", "accept (+ wait for the GPU)",
                "apply (+ context store launch)"} <= phases
        # A step without prompt-lookup hits may still skip the drafter: only
        # phases that ran appear, and no drafter phase without a drafter.
        assert (phases & expect) if drafter else not (phases & {"lookup", "draft batch"})
        assert r["step_ms"] > 0 and r["untimed_ms"] >= 0 and r["mean_acceptance_length"] >= 1
        assert sum(r["phases_ms"].values()) <= r["step_ms"]


def test_phases_of_an_async_step(tmp_path):
    hf = make_target(tmp_path / "t", seed=4)
    add_tokenizer(tmp_path / "t", hf.config.vocab_size)
    make_drafter(tmp_path / "d", hf.config)
    llm = LLM(tmp_path / "t", tmp_path / "d", cuda_graphs=True, async_scheduling=True, max_model_len=256,
              prompt_lookup_min=0)
    r = step_phases.time_phases(llm, "The capital of France is", steps=6)
    phases = set(r["phases_ms"])
    assert {step_phases.LAUNCH, "apply an async step (+ wait for the GPU)"} <= phases
    # No synchronous step among the six: the graph runs the models.
    assert not phases & {"accept (+ wait for the GPU)", "target execute (launch)", "propose (launch + draft argmax)"}
    assert r["untimed_ms"] >= 0 and sum(r["phases_ms"].values()) <= r["step_ms"]


def test_batch_group_times(tmp_path):
    """bench/batch_group_times.py: one wall time per group of the batch, and
    the time of the engine's phases it wraps."""
    import batch_group_times

    hf = make_target(tmp_path / "t", seed=4)
    add_tokenizer(tmp_path / "t", hf.config.vocab_size)
    make_drafter(tmp_path / "d", hf.config)
    llm = LLM(tmp_path / "t", tmp_path / "d", cuda_graphs=True, async_scheduling=True, max_model_len=256)
    prompts = [[5, 6, 7, 8] * (i + 1) for i in range(5)]
    r = batch_group_times.group_times(llm, prompts, batch_size=2, max_tokens=12)
    assert len(r["group_ms"]) == 3 and 0 < r["tokens"] <= 5 * 12
    assert r["calls"]["store_context"] >= 3 and r["calls"]["launch_decode"] > 0
    assert sum(r["group_ms"]) <= 1000 * r["wall_s"] + 1

"""The Ray Data actor pool behind ``specray batch``: the replica actors
that run whole batches through one engine each (``Replica``, the
``map_batches`` callable), and the driver loop that feeds them the pending
rows and appends each finished batch as it arrives (``_execute``). What to
run, resume and the summary are ``specray.batch``'s.

Scale-out: Ray Data actor pools
-------------------------------
The driver reads and validates the input, then hands the runnable rows to
``ray.data.from_items(...).map_batches(Replica, compute=ActorPoolStrategy(
size=R))``. Each ``Replica`` actor builds one ``LLM`` when it starts: an
in-process engine (target + drafter in the actor, on its own CPU cores or one
GPU) or, with ``--tp`` > 1, ``backend="ray"``, where the replica actor only
coordinates (it requests no GPU) and the engine starts its own target TP group
and drafter actor in a placement group. Every call hands the engine a whole
batch of ``--batch-size`` rows through one ``llm.generate`` so continuous
batching keeps the engine full; the driver consumes finished batches
(``iter_batches``, completion order) and writes them out immediately. A replica
runs one batch at a time with the next one already queued on it
(``max_tasks_in_flight_per_actor=2``); a batch returns when its slowest row
finishes, so ``--batch-size`` trades engine occupancy (large) against the tail
of each batch and the granularity of progress and resume (small). The default
is up to 64 rows, at least two batches per replica.

Why Ray Data rather than a hand-written scheduler: the pool gives us actor
start-up with resource requests (CPUs / GPUs per replica), a work queue that
feeds whichever replica is free (uneven prompt lengths balance themselves),
backpressure between a fast reader and slow replicas, streaming of results to
the driver as they complete, actor-failure handling and clean teardown when
the driver exits or is killed -- all of which a hand-written
``ray.util.ActorPool`` loop would re-implement. What we keep for ourselves is
what Ray Data does not know: validation, per-row error capture, and an
append-only, resumable sink. (We do not use ``Dataset.write_*``: its files
appear per block at the end of a write task and it has no notion of "rows
already done", which resume needs.)
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field

from specray.batch_io import BatchError
from specray.detokenizer import chat_prompt_ids
from specray.faults import EngineUnavailable
from specray.priority import local_ray_env, normal_priority
from specray.request import PromptsRefused


def _reason(out) -> str:
    """A failed row's reason: the last line of its engine error."""
    lines = [ln for ln in (out.error or "").splitlines() if ln.strip()]
    return f"the engine failed this row: {lines[-1].strip() if lines else out.finish_reason}"[:1000]


def _unavailable(base: dict, e: Exception) -> dict:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return {**base, "error": f"the engine was unavailable: {lines[0] if lines else e}"[:1000],
            "error_stage": "unavailable"}


# =================================================================== replica
RESULT_COLUMNS = ("line", "id_json", "text", "prompt_tokens", "completion_tokens", "finish_reason",
                  "mean_acceptance_length", "decode_steps", "accepted_sum", "error", "error_stage")


def _result_schema():
    import pyarrow as pa

    return pa.schema([
        ("line", pa.int64()), ("id_json", pa.string()), ("text", pa.string()),
        ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("finish_reason", pa.string()),
        ("mean_acceptance_length", pa.float64()), ("decode_steps", pa.int64()), ("accepted_sum", pa.int64()),
        ("error", pa.string()), ("error_stage", pa.string()),
    ])


class Replica:
    """One engine replica inside a Ray Data actor: builds its ``LLM`` once,
    then runs whole batches through one ``generate`` call each. Rows the
    engine refuses (too long, template errors, ...) or that fail alone in it
    come back as error rows; the rest of the batch runs. A batch the engine
    lost a worker under comes back as error rows of stage "unavailable",
    which a rerun runs again (the engine is rebuilt for the next batch)."""

    def __init__(self, llm_kwargs: dict, num_threads: int | None = None):
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        from specray.llm import LLM

        normal_priority()  # a Ray Data actor: its engine steps in this process (in-process backend) or its own
        self.llm = LLM(**llm_kwargs)

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else batch
        results = self.run(rows)
        return pa.Table.from_pylist(results, schema=_result_schema())

    # ------------------------------------------------------------------
    def _prompt(self, task: dict) -> str | list[int]:
        if "prompt" in task:
            return task["prompt"]
        tok = self.llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("the target has no chat template: give a prompt string instead of messages")
        try:
            return chat_prompt_ids(tok, task["messages"])
        except Exception as e:  # jinja errors (e.g. a role the template rejects)
            raise ValueError(f"chat template failed: {e}") from None

    def run(self, rows: list[dict]) -> list[dict]:
        from specray.sampling import SamplingParams

        out: list[dict] = []
        todo = []  # (row, prompt, params)
        for row in rows:
            base = {c: None for c in RESULT_COLUMNS}
            base.update(line=row["line"], id_json=row["id_json"])
            try:
                task = json.loads(row["task"])
                prompt = self._prompt(task)
                params = SamplingParams(**task["params"])
                if self.llm.engine is not None:  # in-process: the engine judges each row up front
                    self.llm.engine.make_request(prompt, params)
            except ValueError as e:
                out.append({**base, "error": str(e)})
                continue
            todo.append((base, prompt, params))

        while todo:
            try:
                outputs = self.llm.generate([p for _, p, _ in todo], [sp for _, _, sp in todo], errors="return")
            except EngineUnavailable as e:
                out.extend(_unavailable(base, e) for base, _, _ in todo)
                break
            except PromptsRefused as e:  # (Ray backend) record those, run the others
                for i, reason in sorted(e.refused, reverse=True):
                    base, _, _ = todo.pop(i)
                    out.append({**base, "error": reason})
                continue
            except ValueError as e:
                if len(todo) == 1:
                    base, _, _ = todo.pop()
                    out.append({**base, "error": str(e)})
                    continue
                # Unattributed: isolate by running rows one at a time.
                for item in todo:
                    out.extend(self.run_one(item))
                break
            for (base, _, _), o in zip(todo, outputs):
                if o.finish_reason == "error":
                    out.append({**base, "error": _reason(o)})
                    continue
                acc = o.metrics.acceptance_lengths
                out.append({
                    **base,
                    "text": o.text,
                    "prompt_tokens": len(o.prompt_token_ids),
                    "completion_tokens": len(o.token_ids),
                    "finish_reason": o.finish_reason,
                    "mean_acceptance_length": o.metrics.mean_acceptance_length,
                    "decode_steps": len(acc),
                    "accepted_sum": sum(acc),
                })
            break
        return out

    def run_one(self, item) -> list[dict]:
        base, prompt, params = item
        try:
            (o,) = self.llm.generate([prompt], [params], errors="return")
        except EngineUnavailable as e:
            return [_unavailable(base, e)]
        except ValueError as e:
            return [{**base, "error": str(e)}]
        if o.finish_reason == "error":
            return [{**base, "error": _reason(o)}]
        acc = o.metrics.acceptance_lengths
        return [{**base, "text": o.text, "prompt_tokens": len(o.prompt_token_ids),
                 "completion_tokens": len(o.token_ids), "finish_reason": o.finish_reason,
                 "mean_acceptance_length": o.metrics.mean_acceptance_length,
                 "decode_steps": len(acc), "accepted_sum": sum(acc)}]

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:
                pass


# ==================================================================== driver
@dataclass
class Progress:
    """Running totals of this run, for the bar and the summary."""

    rows: int = 0
    errors: int = 0
    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    start: float = field(default_factory=time.perf_counter)
    first_result: float | None = None  # replicas up and the first batch back
    first_tokens: int = 0  # output tokens of that first batch
    end: float | None = None

    @property
    def steady_tokens_per_s(self) -> float:
        """Output tokens/s after the first batch came back (replica start-up
        and model loading excluded)."""
        if self.first_result is None or self.end is None or self.end <= self.first_result:
            return 0.0
        return (self.tokens - self.first_tokens) / (self.end - self.first_result)

    @property
    def elapsed(self) -> float:
        return max((self.end or time.perf_counter()) - self.start, 1e-9)

    @property
    def mean_acceptance_length(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


def _connect_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to ``address`` / ``RAY_ADDRESS`` (inside ``ray job submit``),
    or start a local Ray bound to loopback. Returns whether we started
    the connection (and must close it)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        # A private local cluster: loopback only (must precede `import ray`).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        kw = {}
        host, _, port = address.split("://")[-1].rpartition(":")
        if port.isdigit():
            # ray.init retries an address nothing listens on for good: a
            # mistyped --address hung the job without a word.
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
            except OSError as e:
                raise BatchError(f"no Ray cluster answers at {address} ({e}): check --address / RAY_ADDRESS") from None
        if host in ("127.0.0.1", "localhost"):
            kw["_node_ip_address"] = "127.0.0.1"  # a loopback cluster: this driver is on its node
        ray.init(address=address, logging_level="WARNING", **kw)
    else:
        # "local": a new private instance even if a `ray start` cluster runs here.
        local_ray_env()
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 logging_level="WARNING")
    return True



def _execute(args, llm_kwargs, pending, sink, errlog, prog, done: set, done_before: int, total: int) -> None:
    """Run the pending rows through the replica pool; append each finished
    batch as it arrives. ``done`` (id keys in the output) guards against a
    batch delivered twice."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext
    from tqdm import tqdm

    owns_ray = _connect_ray(args.address, args.num_cpus)
    try:
        ctx = DataContext.get_current()
        ctx.enable_progress_bars = False  # ours is below
        ctx.actor_init_max_retries = 1  # a replica that cannot load its model will not load on retry
        gpu = llm_kwargs["device"] != "cpu"
        inprocess = llm_kwargs["backend"] == "inprocess"
        cpus = args.cpus_per_replica if args.cpus_per_replica is not None else (1.0 if inprocess else 0.0)
        gpus = (args.gpus_per_replica or 1.0) if (gpu and inprocess) else 0.0
        if owns_ray:
            # On the private cluster a replica it can never place would wait
            # forever (an autoscaling cluster may still add the node; the Ray
            # engine checks its own actors when it starts them).
            from specray.placement import _check_resources

            _check_resources(ray, {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0})
        batch_size = args.batch_size or max(1, min(64, math.ceil(len(pending) / (2 * args.replicas))))
        args.batch_size = batch_size
        threads = max(1, int(cpus)) if (inprocess and not gpu) else None
        ds = ray.data.from_items(pending, override_num_blocks=max(1, math.ceil(len(pending) / batch_size)))
        ds = ds.map_batches(
            Replica,
            fn_constructor_kwargs={"llm_kwargs": llm_kwargs, "num_threads": threads},
            batch_size=batch_size,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=args.replicas, max_tasks_in_flight_per_actor=2),
            num_cpus=cpus,
            num_gpus=gpus,
        )
        bar = tqdm(total=total, initial=done_before, unit="row", dynamic_ncols=True, file=sys.stderr,
                   disable=args.no_progress, mininterval=0.5, smoothing=0.1)
        prog.start = time.perf_counter()
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
                first = prog.first_result is None
                if first:
                    prog.first_result = time.perf_counter()
                ok, bad = [], []
                for r in batch.to_pylist():
                    rid = json.loads(r["id_json"])
                    if r["id_json"] in done:
                        continue
                    done.add(r["id_json"])
                    if r["error"] is not None:
                        # "unavailable": a lost worker's, not the row's: a rerun runs it again
                        bad.append({"line": r["line"], "id": rid, "stage": r.get("error_stage") or "engine",
                                    "reason": r["error"]})
                        continue
                    ok.append({"id": rid, "text": r["text"], "prompt_tokens": r["prompt_tokens"],
                               "completion_tokens": r["completion_tokens"], "finish_reason": r["finish_reason"],
                               "mean_acceptance_length": round(r["mean_acceptance_length"], 4)})
                    prog.tokens += r["completion_tokens"]
                    prog.steps += r["decode_steps"]
                    prog.accepted += r["accepted_sum"]
                if first:
                    prog.first_tokens = prog.tokens
                sink.append(ok)  # rows first: they are the record of what is done
                errlog.append(bad)
                prog.rows += len(ok)
                prog.errors += len(bad)
                bar.update(len(ok) + len(bad))
                bar.set_postfix_str(
                    f"{prog.tokens / prog.elapsed:.1f} tok/s, acc {prog.mean_acceptance_length:.2f}, "
                    f"errors {prog.errors}", refresh=False)
            prog.end = time.perf_counter()
        finally:
            bar.close()
    finally:
        if owns_ray:
            ray.shutdown()


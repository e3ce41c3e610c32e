"""Batch generation over JSONL / Parquet, locally or as a ``ray job submit``
entry point (``specray batch ...`` or ``python deploy/ray/batch_job.py ...``).

Input: one record per JSONL line (or Parquet row) with an ``id`` and either a
``prompt`` string or OpenAI-style ``messages`` (rendered with the target's
chat template), plus optional per-row ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop`` and ``min_tokens`` overriding the command-line
defaults. Output, in the input's format: one row per input id with ``id``,
``text``, ``prompt_tokens``, ``completion_tokens``, ``finish_reason`` and
``mean_acceptance_length``. Rows that cannot run go to ``OUTPUT.errors.jsonl``
(``line``, ``id`` when known, ``stage``, ``reason``) and never stop the job.

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

Resume: see ``specray.batch_io`` (the output is the record of what is done).
Rows are matched by id, never by line: on a rerun the errors file is
rewritten to describe the current input (its input errors, and the engine
errors of ids it still holds; ``--retry-errors`` drops those; rows of stage
"unavailable", cut by a lost engine worker, always run again), and the
summary records the settings, so a resumed job can say which changed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specray.batch_io import (
    BatchError,
    JsonlLog,
    Sink,
    _atomic_write_text,
    _dump_line,
    _missing,
    detect_format,
    id_key,
    read_records,
    record_id,
    validate_record,
)
from specray.cli import add_model_args, drafting_args
from specray.config import ConfigError
from specray.detokenizer import chat_prompt_ids
from specray.faults import EngineUnavailable
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
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 logging_level="WARNING")
    return True


def _engine_kwargs(args, target: str, drafter: str | None) -> dict:
    kw: dict = dict(target=target, drafter=drafter, device=args.device, dtype=args.dtype,
                    num_speculative_tokens=args.num_speculative_tokens, **drafting_args(args))
    if args.async_scheduling is not None:
        kw["async_scheduling"] = args.async_scheduling
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    for item in args.engine_arg or []:
        if "=" not in item:
            raise BatchError(f"--engine-arg wants KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            kw[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            kw[k.strip()] = v
    backend = args.backend
    if backend == "auto":
        backend = "ray" if args.tp > 1 else "inprocess"
    kw["backend"] = backend
    if backend == "ray":
        kw["tensor_parallel_size"] = args.tp
        kw["drafter_placement"] = args.drafter_placement
    elif args.tp != 1:
        raise BatchError("--tp > 1 needs --backend ray (or auto)")
    elif str(args.device).startswith("cuda"):
        kw["device"] = "cuda"  # an in-process replica sees only the GPU Ray gave it
    return kw


def _check_models(kw: dict, strict: bool) -> None:
    """Cheap up-front check of the checkpoints (config.json only). On a
    cluster they may live only on the workers' disks: unless ``strict``
    (a private local cluster), directories the driver cannot see are left to
    the replicas."""
    from specray.config import DrafterSpec, EngineConfig, TargetSpec
    from specray.llm import resolve_max_model_len

    try:
        config = EngineConfig(**{k: v for k, v in kw.items()
                                 if k not in ("backend", "tensor_parallel_size", "drafter_placement")})
    except (TypeError, ValueError) as e:
        raise BatchError(f"bad engine setting: {e}") from None
    if not strict and not Path(kw["target"]).is_dir():
        return
    t = TargetSpec.from_dir(kw["target"])
    # What the replicas would refuse from config.json alone: left to them,
    # each failed to start and the job said "failed; rerun to resume".
    resolve_max_model_len(config, t)
    if kw.get("drafter") and (strict or Path(kw["drafter"]).is_dir()):
        d = DrafterSpec.from_dir(kw["drafter"])
        d.check_fits(t)
        config.draft_block_size(d.block_size)


def default_paths(output: Path, errors: str | None, summary: str | None) -> tuple[Path, Path]:
    return (
        Path(errors) if errors else output.with_name(output.name + ".errors.jsonl"),
        Path(summary) if summary else output.with_name(output.name + ".summary.json"),
    )


def run(args) -> dict:
    """The whole job; returns the summary (also written beside the output)."""
    t_start = time.perf_counter()
    inp, output = Path(args.input), Path(args.output)
    if inp.is_dir():  # e.g. a Parquet dataset as Spark / Ray Data write them
        raise BatchError(f"input {inp} is a directory: give one .jsonl or .parquet file (one job per file)")
    if not inp.is_file():
        raise BatchError(f"input file {inp} does not exist")
    fmt = detect_format(inp)
    if fmt is None:
        raise BatchError(f"cannot tell the format of {inp}: use .jsonl/.ndjson/.json (JSON Lines) or .parquet")
    out_fmt = detect_format(output)
    if out_fmt is not None and out_fmt != fmt:
        raise BatchError(f"the output is written in the input's format ({fmt}); {output} says {out_fmt}")
    errors_path, summary_path = default_paths(output, args.errors, args.summary)
    paths = [p.resolve() for p in (inp, output, errors_path, summary_path)]
    if len(set(paths)) < 4:
        raise BatchError("--input, --output, --errors and --summary must be four different files")
    for p in paths[1:]:
        if p.is_dir():
            raise BatchError(f"{p} is a directory: --output, --errors and --summary name files")
    if args.replicas < 1 or args.tp < 1:
        raise BatchError("--replicas and --tp must be at least 1")
    if args.batch_size is not None and args.batch_size < 1:
        raise BatchError(f"--batch-size must be at least 1, got {args.batch_size}")

    from specray.cli import resolve_models

    try:
        target, drafter = resolve_models(args)
    except ImportError as e:
        raise BatchError(f"the embedded default model is not available ({e}): pass --target DIR "
                         "(and --drafter DIR or --no-drafter)") from None
    llm_kwargs = _engine_kwargs(args, target, drafter)
    _check_models(llm_kwargs, strict=not (args.address or os.environ.get("RAY_ADDRESS")))

    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.seed, "stop": args.stop}
    try:
        from specray.sampling import SamplingParams

        SamplingParams(**defaults)
    except ValueError as e:
        raise BatchError(f"invalid sampling options: {e}") from None

    settings = {"target": target, "drafter": drafter, "sampling": defaults,
                "engine": {k: v for k, v in llm_kwargs.items() if k not in ("target", "drafter")}}

    # ---- read + validate in the driver (cheap checks only)
    tasks: list[dict] = []  # {"line", "id_json", "task"}
    input_errors: list[dict] = []
    first_seen: dict[str, int] = {}
    order: dict[str, int] = {}
    n_records = 0
    for line, rec in read_records(inp, fmt):
        n_records += 1
        task, why = validate_record(rec, defaults)
        rid = record_id(rec)
        if task is not None:
            k = id_key(task["id"])
            if k in first_seen:
                task, why = None, f"duplicate id (first on line {first_seen[k]})"
            else:
                first_seen[k] = line
                order[k] = line
        if task is None:
            err = {"line": line, "stage": "input", "reason": why}
            if not _missing(rid) and isinstance(rid, (str, int)) and not isinstance(rid, bool):
                err = {"line": line, "id": rid, "stage": "input", "reason": why}
            input_errors.append(err)
            continue
        tasks.append({"line": line, "id_json": id_key(task["id"]), "task": json.dumps(task)})

    # ---- resume state
    sink = Sink(output, fmt)
    errlog = JsonlLog(errors_path)
    try:
        done = sink.open()
        errlog.open()
        errlog_discarded = errlog.discarded_bytes
        # The errors file describes this input: its input errors are this
        # run's, and an engine error stands (unless retried) for an id this
        # input still runs. Rows are matched by id, never by line: a line
        # number names another row once the input is edited.
        current = {t["id_json"] for t in tasks}
        engine_errors = [e for e in errlog.rows if e.get("stage") == "engine" and "id" in e
                         and id_key(e["id"]) in current and not args.retry_errors]
        before = {_dump_line(e) for e in errlog.rows}
        new_input_errors = [e for e in input_errors if _dump_line(e) not in before]
        if errlog.rows != input_errors + engine_errors:
            errlog.close()
            _atomic_write_text(errors_path, "".join(_dump_line(e).decode("utf-8")
                                                    for e in input_errors + engine_errors))
            errlog = JsonlLog(errors_path).open()
        engine_done = {id_key(e["id"]) for e in engine_errors}
        pending = [t for t in tasks if t["id_json"] not in done and t["id_json"] not in engine_done]
        resumed = len(tasks) - len(pending)
        ok_before = len(done & order.keys())
        unknown = len(done) - ok_before
        if sink.log.discarded_bytes or errlog_discarded:
            print(f"specray batch: discarded a partial last line ({sink.log.discarded_bytes} B in "
                  f"{sink.log_path.name}, {errlog_discarded} B in {errors_path.name})", file=sys.stderr)
        if resumed:
            print(f"specray batch: resuming: {resumed} of {len(tasks)} rows already done", file=sys.stderr)
            changed = _changed_settings(summary_path, settings)
            if changed:
                print(f"specray batch: warning: the earlier run used other settings ({', '.join(changed)}); "
                      "rows already done keep what it generated", file=sys.stderr)
        if unknown:
            print(f"specray batch: warning: {sink.log_path} holds {unknown} ids that are not in {inp}",
                  file=sys.stderr)

        prog = Progress()
        status = "complete"
        failure = None
        if pending:
            try:
                _execute(args, llm_kwargs, pending, sink, errlog, prog, done, done_before=resumed,
                         total=len(tasks))
            except KeyboardInterrupt:
                status, failure = "interrupted", "interrupted"
            except (BatchError, ConfigError):  # the job as given cannot run: rerunning would not help
                raise
            except Exception as e:  # a replica died, the cluster went away, ...
                lines = [ln for ln in str(e).splitlines() if ln.strip()]
                status, failure = "failed", f"{type(e).__name__}: {lines[-1] if lines else ''}"[:1000]
        if status == "complete":
            sink.finalize(order)
        n_errors = len(errlog.rows) + prog.errors
    finally:
        sink.close()
        errlog.close()

    pipeline_s = prog.elapsed if pending else 0.0
    summary = {
        "status": status,
        "input": str(inp),
        "output": str(output),
        "errors_file": str(errors_path),
        "rows_input": n_records,
        "rows_ok": ok_before + prog.rows,
        "rows_generated": prog.rows,
        "rows_resumed": resumed,
        "errors": n_errors,
        "errors_new": len(new_input_errors) + prog.errors,
        "wall_s": round(time.perf_counter() - t_start, 3),
        "generate_s": round(pipeline_s, 3),
        "first_batch_s": round(prog.first_result - prog.start, 3) if prog.first_result else None,
        "output_tokens": prog.tokens,
        "output_tokens_per_s": round(prog.tokens / pipeline_s, 2) if pipeline_s else 0.0,
        "rows_per_s": round(prog.rows / pipeline_s, 3) if pipeline_s else 0.0,
        "steady_output_tokens_per_s": round(prog.steady_tokens_per_s, 2),
        "mean_acceptance_length": round(prog.mean_acceptance_length, 4),
        "replicas": args.replicas,
        "tp": args.tp,
        "batch_size": args.batch_size,
        "backend": llm_kwargs["backend"],
        "target": target,
        "drafter": drafter,
        "settings": settings,
    }
    if unknown:
        summary["rows_not_in_input"] = unknown
    if failure:
        summary["failure"] = failure
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(summary_path, json.dumps(summary, indent=2) + "\n")
    return summary


def _changed_settings(summary_path: Path, settings: dict) -> list[str]:
    """The settings (by name) an earlier run of this job used differently."""
    try:
        before = json.loads(summary_path.read_text()).get("settings")
    except (OSError, ValueError):
        return []
    if not isinstance(before, dict):
        return []
    now = json.loads(json.dumps(settings))  # as the summary stores them
    out = []
    for group in now:
        a, b = before.get(group), now[group]
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{group}: {a!r} -> {b!r}")
    return out


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specray batch",
        description="Batch generation over a JSONL or Parquet file with DFlash speculative decoding on Ray "
        "(resumable: rerun the same command after an interruption).",
    )
    p.add_argument("--input", required=True, help="JSONL (.jsonl/.ndjson/.json) or Parquet (.parquet) rows")
    p.add_argument("--output", required=True, help="written in the input's format; rerun to resume")
    p.add_argument("--errors", help="error rows (default: OUTPUT.errors.jsonl)")
    p.add_argument("--summary", help="run summary JSON (default: OUTPUT.summary.json)")
    m = p.add_argument_group("model")
    add_model_args(m)  # an in-process replica on --device cuda takes --gpus-per-replica GPUs
    m.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                   help="extra EngineConfig field, e.g. max_num_seqs=128 or num_kv_blocks=4096 (repeatable)")
    s = p.add_argument_group("scale-out")
    s.add_argument("--replicas", type=int, default=1, help="engine replicas (Ray Data actor pool size)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each replica's target")
    s.add_argument("--backend", choices=["auto", "inprocess", "ray"], default="auto",
                   help="auto: in-process engine per replica, or the Ray engine when --tp > 1")
    s.add_argument("--drafter-placement", choices=["auto", "separate", "colocated"], default="auto")
    s.add_argument("--batch-size", type=int, help="rows per generate call (default: up to 64)")
    s.add_argument("--cpus-per-replica", type=float,
                   help="CPUs each replica actor requests (default 1 in-process, 0 with the Ray engine)")
    s.add_argument("--gpus-per-replica", type=float,
                   help="GPU share of an in-process replica on --device cuda (default 1; e.g. 0.5 puts two "
                   "replicas of a small model on one GPU). Ray-engine replicas request none: their "
                   "target ranks and drafter take one GPU each")
    s.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a private local cluster)")
    s.add_argument("--num-cpus", type=int, help="CPUs of a private local cluster")
    g = p.add_argument_group("sampling defaults (rows may override)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    o = p.add_argument_group("other")
    o.add_argument("--retry-errors", action="store_true", help="rerun rows the engine refused in an earlier run")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = run(args)
    except (BatchError, ConfigError, FileNotFoundError) as e:
        print(f"specray batch: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    if summary["status"] != "complete":
        print(f"specray batch: {summary['status']}: {summary.get('failure')}; rerun the same command to resume",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Run the imported module's main so that Ray pickles specray.batch.Replica
    # by reference, not a copy of this __main__.
    from specray.batch import main as _main

    sys.exit(_main())

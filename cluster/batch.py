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

Scale-out: the rows run on a Ray Data actor pool of engine replicas
(``specray.batch_pool``, which says why Ray Data); this module is the job
around it: reading and validating the input, resume, the summary, the CLI.

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
import os
import sys
import time
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
from specray.batch_pool import Progress, _execute
from specray.batch_pool import Replica  # noqa: F401  (part of this module's interface)
from specray.cli import add_model_args, drafting_args
from specray.config import ConfigError


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
    s.add_argument("--drafter-placement", choices=["auto", "separate", "colocated", "separate_same_gpu"],
                   default="auto")
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
    sys.exit(main())

"""Batch job input and output: reading and validating records, and the
append-only, resumable sinks the driver writes.

Resume
------
The output is the record of what is done. JSONL rows are appended by the
driver only (one writer, guarded by ``flock``), one ``os.write`` per finished
batch on an ``O_APPEND`` descriptor, then ``fsync``: a killed process (SIGKILL
included) leaves whole lines, and a crash of the machine can leave at most one
partial last line. A rerun scans the output, truncates a trailing partial /
unparsable line, skips every input id already present, and appends the rest,
so no id is ever written twice. The errors file is scanned the same way:
engine-stage errors (e.g. prompt too long) count as done; input-stage errors
(bad JSON, missing fields, invalid params, duplicate ids) are recomputed each
run and appended only for lines not already recorded. ``--retry-errors``
drops engine-stage errors first so those rows run again.

Parquet output cannot be appended to safely, so rows are staged as JSONL in
``OUTPUT.staging.jsonl`` with exactly the rules above; when every row is done,
the staged rows (plus those of an existing ``OUTPUT``) are sorted into input
order and written to ``OUTPUT.tmp``, which is renamed over ``OUTPUT``
(atomic), and only then is the staging file removed. A kill at any point
leaves either the old complete file or the new one, and the next run merges
again, keeping one row per id.

Every line of the input ends in exactly one of the output or the errors file.
JSONL output rows appear in completion order (each carries its ``id``);
Parquet output is sorted into input order by the merge.

The driver holds the validated rows in memory (about the size of the input)
and the set of finished ids: fine for inputs of millions of short rows; shard
larger inputs into several files / jobs.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path

PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "min_tokens",
                "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_FIELDS = ("max_tokens", "top_k", "seed", "min_tokens")
OUTPUT_FIELDS = ("id", "text", "prompt_tokens", "completion_tokens", "finish_reason", "mean_acceptance_length")
JSONL_EXTS = (".jsonl", ".ndjson", ".json")
PARQUET_EXTS = (".parquet", ".pq")


class BatchError(Exception):
    """A problem with the job as a whole (arguments, files): exit code 2."""


# ======================================================================= input
def detect_format(path: str | os.PathLike) -> str | None:
    name = str(path).lower()
    if name.endswith(JSONL_EXTS):
        return "jsonl"
    if name.endswith(PARQUET_EXTS):
        return "parquet"
    return None


def read_records(path: str | os.PathLike, fmt: str):
    """Yield ``(line, record_or_error)``: ``line`` is the 1-based line (JSONL)
    or row (Parquet) number; a record that cannot be read comes as a
    string saying why."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise BatchError(f"cannot read {path} as Parquet: {e}") from None
        for i, rec in enumerate(table.to_pylist(), start=1):
            yield i, rec
        return
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines (a trailing newline, spacing) are not records
            try:
                yield i, json.loads(raw)
            except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, an int over 4300 digits; too deep
                yield i, Unreadable(f"invalid JSON: {type(e).__name__}: {e}"[:500])


class Unreadable(str):
    """Why a line could not be read (a line holding a JSON string is a record)."""


def record_id(rec):
    """A record's id as rows carry it (None for no id): Parquet written by
    pandas stores nullable int ids as floats."""
    rid = rec.get("id") if isinstance(rec, dict) else None
    if isinstance(rid, float) and rid.is_integer():
        rid = int(rid)
    return rid


def id_key(value) -> str:
    """Canonical form of an id for set membership (1 and "1" differ)."""
    return json.dumps(value, sort_keys=True)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _check_messages(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content} objects"
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{j}] must be an object with role and content"
        if not isinstance(m.get("role"), str) or not m["role"]:
            return f"messages[{j}].role must be a non-empty string"
        if not isinstance(m.get("content"), str):
            return f"messages[{j}].content must be a string"
    return None


def validate_record(rec, defaults: dict) -> tuple[dict | None, str | None]:
    """``(task, None)`` for a runnable record, ``(None, reason)`` otherwise.
    A task is ``{"id", "prompt" | "messages", "params"}`` with the sampling
    params already checked by ``SamplingParams``."""
    from specray.sampling import SamplingParams

    if isinstance(rec, Unreadable):
        return None, str(rec)
    if not isinstance(rec, dict):
        return None, f"a row must be a JSON object, got {type(rec).__name__}"
    rid = record_id(rec)
    if _missing(rid):
        return None, "missing id"
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return None, f"id must be a non-empty string or an integer, got {rid!r}"
    prompt, messages = rec.get("prompt"), rec.get("messages")
    if not _missing(prompt) and not _missing(messages):
        return None, "give either prompt or messages, not both"
    task: dict = {"id": rid}
    if not _missing(prompt):
        if not isinstance(prompt, str) or not prompt:
            return None, "prompt must be a non-empty string"
        task["prompt"] = prompt
    elif not _missing(messages):
        why = _check_messages(messages)
        if why:
            return None, why
        task["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        return None, "missing prompt or messages"
    params = dict(defaults)
    for k in PARAM_FIELDS:
        v = rec.get(k)
        if _missing(v):
            continue
        if k in INT_FIELDS and isinstance(v, float) and v.is_integer():
            v = int(v)  # Parquet written by pandas stores nullable ints as floats
        if k == "stop" and isinstance(v, tuple):
            v = list(v)
        params[k] = v
    try:
        SamplingParams(**params)
    except (ValueError, TypeError, OverflowError) as e:
        return None, f"invalid sampling params: {e}"
    task["params"] = params
    return task, None


# ================================================================ JSONL files
class JsonlLog:
    """An append-only JSONL file of finished rows that survives kills.

    ``open()`` takes an exclusive ``flock`` (one writer), scans the existing
    lines and truncates a partial or unparsable *last* line (what a crash can
    leave); a bad line anywhere else means the file is not ours: refuse.
    ``append(rows)`` writes all rows in one ``write`` on an ``O_APPEND``
    descriptor, then ``fsync``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: int | None = None
        self.rows: list[dict] = []
        self.discarded_bytes = 0

    def open(self, lock: bool = True) -> JsonlLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if lock:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self.fd)
                self.fd = None
                raise BatchError(f"{self.path} is being written by another batch job") from None
        self.rows, good_end, size = self._scan()
        if good_end < size:
            self.discarded_bytes = size - good_end
            os.ftruncate(self.fd, good_end)
            os.fsync(self.fd)
        return self

    def _scan(self) -> tuple[list[dict], int, int]:
        with open(self.path, "rb") as f:
            data = f.read()
        rows, pos, lineno = [], 0, 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            lineno += 1
            last = end == -1 or end == len(data) - 1
            if end == -1:  # no newline: a torn last write
                break
            line = data[pos:end]
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not an object")
            except ValueError:
                if last:
                    break
                raise BatchError(
                    f"{self.path}: line {lineno} is not a JSON row and is not the last line; "
                    "this file was not written by specray batch (move it away or pick another --output)"
                ) from None
            rows.append(obj)
            pos = end + 1
        return rows, pos, len(data)

    def append(self, rows: list[dict]) -> None:
        if not rows:
            return
        buf = b"".join(_dump_line(r) for r in rows)
        view = memoryview(buf)
        while view:  # a regular file takes it in one write; loop for safety
            n = os.write(self.fd, view)
            view = view[n:]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def _dump_line(row: dict) -> bytes:
    """One JSON line, UTF-8. U+2028/2029 are escaped too: readers that split
    on every Unicode line break (``str.splitlines``) still see one row."""
    try:
        text = json.dumps(row, ensure_ascii=False).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: escape everything
        return (json.dumps(row) + "\n").encode("ascii")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ===================================================================== sinks
class Sink:
    """Where finished rows go. JSONL: the output file itself. Parquet: a JSONL
    staging file, merged into the Parquet output by ``finalize``."""

    def __init__(self, output: Path, fmt: str):
        self.output, self.fmt = Path(output), fmt
        self.log_path = self.output if fmt == "jsonl" else self.output.with_name(self.output.name + ".staging.jsonl")
        self.log = JsonlLog(self.log_path)
        self.existing: list[dict] = []  # rows of an existing Parquet output

    def open(self) -> set[str]:
        """Open for appending; return the id keys already done."""
        self.log.open()
        if self.fmt == "parquet" and self.output.exists():
            import pyarrow.parquet as pq

            self.existing = pq.read_table(self.output).to_pylist()
        return {id_key(r.get("id")) for r in (*self.existing, *self.log.rows)}

    def append(self, rows: list[dict]) -> None:
        self.log.append(rows)

    def finalize(self, order: dict[str, int]) -> None:
        """Parquet: merge existing + staged rows (one per id, input order)
        into ``OUTPUT`` atomically, then drop the staging file."""
        if self.fmt != "parquet":
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        staged = JsonlLog(self.log_path)
        staged.rows, _, _ = staged._scan() if self.log_path.exists() else ([], 0, 0)
        rows, seen = [], set()
        for r in (*self.existing, *staged.rows):
            k = id_key(r.get("id"))
            if k not in seen:
                seen.add(k)
                rows.append({f: r.get(f) for f in OUTPUT_FIELDS})
        rows.sort(key=lambda r: order.get(id_key(r["id"]), float("inf")))
        int64_ids = all(isinstance(r["id"], int) and -2**63 <= r["id"] < 2**63 for r in rows)
        id_type = pa.int64() if rows and int64_ids else pa.string()
        if id_type == pa.string():
            for r in rows:
                r["id"] = str(r["id"])
        schema = pa.schema([
            ("id", id_type), ("text", pa.string()), ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()), ("finish_reason", pa.string()),
            ("mean_acceptance_length", pa.float64()),
        ])
        tmp = self.output.with_name(self.output.name + ".tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.output)
        self.log.close()
        self.log_path.unlink(missing_ok=True)

    def close(self) -> None:
        self.log.close()

"""Reading and validating records: (where, record) pairs from JSONL / Parquet / arrow sources, each
checked into ("text", str) or ("chat", messages); a bad record raises DataError naming its file and line
or row, or is counted when data.skip_bad_records allows (see runtime.data)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.config import DataConfig

ROLES = ("system", "user", "assistant", "tool")
ARROW_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
SUFFIXES = {"jsonl": (".jsonl", ".ndjson"), "parquet": (".parquet",)}
SKIP_HINT = "fix the record or set data.skip_bad_records: true"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # JSON's way to write half a UTF-16 pair
CHUNK = 1024  # records per tokenizer call and per Arrow batch


class DataError(ValueError):
    """A data problem; the message names the file, the line or row, the problem and the fix."""


class BadRecord(Exception):
    """One record's problem, before the file and line are attached."""


# ---------------------------------------------------------------------------------------------
# Reading: (where, record) pairs from files; unreadable records go to the BadRecords collector.

class BadRecords:
    """Raises on the first bad record, or counts them when skipping is allowed."""

    def __init__(self, skip: bool):
        self.skip = skip
        self.count = 0
        self.first: str | None = None

    def report(self, where: str, problem: str) -> None:
        message = f"{where}: {problem}; {SKIP_HINT}"
        if not self.skip:
            raise DataError(message)
        self.count += 1
        self.first = self.first or message


def detect_format(path: Path) -> str:
    if path.is_dir():
        if any((path / marker).is_file() for marker in ARROW_MARKERS):
            return "arrow"
        found = sorted({fmt for fmt, sfx in SUFFIXES.items() for p in path.iterdir() if p.suffix in sfx})
        if len(found) == 1:
            return found[0]
        what = "mixes .jsonl and .parquet files" if found else "has no .jsonl or .parquet files"
        raise DataError(f"{path}: cannot tell the data format: the folder {what} and is no "
                        "datasets.save_to_disk folder (no dataset_info.json / state.json); set data.format")
    for fmt, sfx in SUFFIXES.items():
        if path.suffix in sfx:
            return fmt
    raise DataError(f"{path}: cannot tell the data format from the extension '{path.suffix}'; name the file "
                    "*.jsonl or *.parquet, or set data.format: jsonl | parquet | arrow")


def _data_files(path: Path, fmt: str) -> list[Path]:
    if fmt == "arrow" or path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES[fmt])
    if not files:
        raise DataError(f"{path}: no {'/'.join(SUFFIXES[fmt])} files in this folder (data.format: {fmt})")
    return files


def _parse_json_line(line: str) -> Any:
    """One JSONL line -> its value, or BadRecord for anything json would raise on (never a traceback)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise BadRecord(f"invalid JSON ({err.msg} at column {err.colno})") from None
    except (ValueError, RecursionError) as err:  # integers over Python's digit limit; absurd nesting
        problem = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
        raise BadRecord(f"invalid JSON ({problem})") from None
    # "\ud800" alone is valid JSON but no text: the tokenizer would fail on it with a TypeError.
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord("a string holds an unpaired UTF-16 surrogate escape (such as \\ud800), which is "
                            "no Unicode character; write the character itself or a complete surrogate pair"
                            ) from None
    return record


def _read_jsonl(file: Path, bad: BadRecords) -> Iterator[tuple[str, Any]]:
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{file}:{lineno}"
            try:
                # Editors on Windows start files with a byte order mark; it is no part of the first record.
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                bad.report(where, f"not valid UTF-8 ({err.reason} at byte {err.start})")
                continue
            if not line.strip():  # blank lines (a trailing newline, spacing) are not records
                continue
            try:
                record = _parse_json_line(line)
            except BadRecord as err:
                bad.report(where, str(err))
                continue
            yield where, record


def _read_parquet(file: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(file).iter_batches(batch_size=CHUNK)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{file}: not a readable Parquet file ({err}); check data.path / data.format") from None
    yield from _table_rows(file, batches)


def _table_rows(source: Path, batches) -> Iterator[tuple[str, Any]]:
    """Rows of Arrow record batches; a batch that cannot be decoded (a corrupt page) is a DataError."""
    import pyarrow as pa

    row = 0
    try:
        for batch in batches:  # decoding happens here, batch by batch
            for record in batch.to_pylist():
                yield f"{source}: row {row} (0-based)", record
                row += 1
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{source}: the rows from row {row} (0-based) on cannot be read ({str(err).rstrip('.')}); "
                        "the file is corrupt: write it again (or leave it out of data.path)") from None


def _read_arrow(folder: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, NotADirectoryError) as err:
        raise DataError(f"{folder}: not a datasets.save_to_disk folder ({err}); check data.path / "
                        "data.format") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{folder}: a DatasetDict with splits {sorted(ds)} and no 'train'; point "
                            "data.path at one split's folder")
        ds = ds["train"]
    yield from _table_rows(folder, ds.with_format("arrow").iter(batch_size=CHUNK))


def read_records(path: Path, fmt: str, bad: BadRecords) -> Iterator[tuple[str, Any]]:
    """Every record of the source in file order, each with the place to name in errors."""
    for file in _data_files(path, fmt):
        if fmt == "jsonl":
            yield from _read_jsonl(file, bad)
        elif fmt == "parquet":
            yield from _read_parquet(file)
        else:
            yield from _read_arrow(file)


# ---------------------------------------------------------------------------------------------
# Validating: a record -> ("text", str) or ("chat", messages), or BadRecord.

def _parse_text(record: dict, field: str) -> str:
    text = record.get(field)
    if text is None:
        raise BadRecord(f"missing field '{field}' (the record has {sorted(record)}); set data.text_field "
                        "or data.messages_field if your field is named differently")
    if not isinstance(text, str):
        raise BadRecord(f"field '{field}' must be a string, got {type(text).__name__}")
    if not text.strip():
        raise BadRecord(f"field '{field}' is empty")
    return text


def _parse_message(i: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise BadRecord(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
    for key in ("role", "content"):
        if message.get(key) is None:
            raise BadRecord(f"messages[{i}] has no '{key}' (it has {sorted(message)}); each message needs "
                            "'role' and 'content'")
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise BadRecord(f"messages[{i}] has unknown role {role!r} (expected one of {', '.join(ROLES)}; map "
                        "ShareGPT-style 'human'/'gpt' to 'user'/'assistant')")
    if not isinstance(content, str):
        raise BadRecord(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
    if role == "assistant" and not content.strip():
        raise BadRecord(f"messages[{i}] is an assistant message with empty content")
    # None-valued keys come from Arrow's struct columns; templates treat them as set.
    return {k: v for k, v in message.items() if v is not None}


def _parse_messages(record: dict, field: str) -> list[dict]:
    messages = record.get(field)
    if messages is None:
        raise BadRecord(f"missing field '{field}' (the record has {sorted(record)}); set data.messages_field "
                        "if your field is named differently")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise BadRecord(f"field '{field}' must be a non-empty list of {{role, content}} objects, got {got}")
    parsed = [_parse_message(i, m) for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in parsed):
        raise BadRecord(f"field '{field}' has no assistant message, so nothing would be trained")
    return parsed


def parse_record(record: Any, cfg: DataConfig) -> tuple[str, Any]:
    if not isinstance(record, dict):
        raise BadRecord(f"expected an object with a '{cfg.text_field}' or '{cfg.messages_field}' field, "
                        f"got {type(record).__name__}")
    kind = cfg.kind
    if kind == "auto":
        kind = "chat" if record.get(cfg.messages_field) is not None else "text"
    if kind == "chat":
        return "chat", _parse_messages(record, cfg.messages_field)
    return "text", _parse_text(record, cfg.text_field)

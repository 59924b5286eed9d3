"""Training data: read records, tokenize them, pack documents into fixed-length rows, batch them.

Sources (`data.path`, `data.format`): a JSONL file, a Parquet file, a folder of either, or a
`datasets.save_to_disk` folder (`arrow`). `auto` decides by extension, or by the dataset_info.json /
state.json that save_to_disk writes.

Records (`data.kind`): plain text (`{text_field: str}`: every token is trained, an eos is appended)
or chat (`{messages_field: [{role, content}, ...]}`: rendered with the tokenizer's chat template,
only the assistant turns' content and end marker are trained). The assistant tokens come from the
template's {% generation %} blocks when it has them (return_assistant_tokens_mask), otherwise from
finding each message's content in the rendered text. `auto` picks chat for records that carry the
messages field. A bad record raises DataError naming its file and JSONL line (1-based) or
Parquet/arrow row (0-based, as `ds[row]`), the problem and the fix; with
`data.skip_bad_records: true` it is skipped, counted (`PackedLoader.num_skipped`) and logged once.
A chat record with nothing to train (no assistant message, an empty assistant message, or a
template that marks none of its tokens) is such a bad record: that is a defect of the record or of
the field mapping, which the user should hear about, not lose silently. JSONL: blank lines are no
records, a UTF-8 byte order mark at the start of a file is ignored.

Chat records longer than `seq_len` (`data.overlong`): a conversation cut into seq_len chunks would
make chunks with no assistant token (a long prompt), i.e. rows and, at small batch sizes, whole
steps with nothing to train. So they are never chunked: `drop` (the default) removes them,
`truncate` keeps their first seq_len tokens (and drops one whose first seq_len tokens hold no
assistant token). Both are counted (`PackedLoader.num_overlong_dropped`, `.num_overlong_truncated`)
and logged once at load; if nothing is left, DataError says which setting to change. Every chat
document in the corpus therefore fits in one row and has at least one label token.

Packing: documents, shuffled by seed, are concatenated greedily into rows of exactly `seq_len`
tokens; a document that does not fit in the rest of a row starts the next one, a text document
longer than `seq_len` is cut into `seq_len` chunks that are separate documents (every token of a
text is trained, so a chunk of n tokens has n - 1 labels; only a 1-token tail chunk has none, and
a row can be label-less only if such a tail is all it holds). What is left of a row is padding,
which forms one more document. Each epoch reshuffles with (seed, epoch). A batch may hold no label
token at all (rare, see above): it is handed out like any other; the trainer skips such a step.

Batch contract (`Batch`): input_ids, labels, position_ids are [B, S] long. Labels are pre-shifted:
labels[b, t] is the token to predict at position t, -100 where nothing is (the last token of each
document, untrained chat tokens, padding). position_ids restart at 0 at every document start.
cu_seqlens (int32, [num_docs + 1]) holds the document boundaries over the flattened B*S tokens and
never crosses a row; max_seqlen and num_label_tokens are python ints, computed here once per batch.

Eval data (`data.eval`, `data.eval_fraction`): a held-out file read like data.path, or a share of
data.path's documents chosen by data.seed (split_eval) and removed from the training corpus, so they
are never trained on. `eval_batches` packs them in file order (no shuffle) and gives every data rank
the same number of batches: of each dp_world * B rows rank r takes rows [r*B, (r+1)*B) (as in training),
and ranks past the end get label-less padding rows, so every rank runs the same forwards (FSDP and EP
collectives stay matched) and the union over ranks is exactly one process's eval set.

Data parallelism and resume: the packed rows form one global stream that depends only on the data,
the tokenizer, seq_len and the seed. Each step takes dp_world * B rows of it and rank r gets rows
[r*B, (r+1)*B), so one process with B' = dp_world * B sees exactly the union of what the ranks see.
Every rank tokenizes the whole dataset (packing needs every document's length) but builds tensors
only for its rows. `state_dict()` is the stream position (epoch, row); loading it makes the next
batches equal those of an uninterrupted loader, even under another dp_world.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import torch

from runtime.config import DataConfig

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
ARROW_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
SUFFIXES = {"jsonl": (".jsonl", ".ndjson"), "parquet": (".parquet",)}
SKIP_HINT = "fix the record or set data.skip_bad_records: true"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # JSON's way to write half a UTF-16 pair
_CHUNK = 1024  # records per tokenizer call and per Arrow batch


class DataError(ValueError):
    """A data problem; the message names the file, the line or row, the problem and the fix."""


class _BadRecord(Exception):
    """One record's problem, before the file and line are attached."""


def load_tokenizer(path: str | Path):
    """A local tokenizer folder -> transformers tokenizer (never downloads)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise DataError(f"tokenizer folder {path} does not exist; set data.tokenizer (or model.path) to a "
                        "local folder with tokenizer.json and tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ---------------------------------------------------------------------------------------------
# Reading: (where, record) pairs from files; unreadable records go to the _BadRecords collector.

class _BadRecords:
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
    """One JSONL line -> its value, or _BadRecord for anything json would raise on (never a traceback)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise _BadRecord(f"invalid JSON ({err.msg} at column {err.colno})") from None
    except (ValueError, RecursionError) as err:  # integers over Python's digit limit; absurd nesting
        problem = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
        raise _BadRecord(f"invalid JSON ({problem})") from None
    # "\ud800" alone is valid JSON but no text: the tokenizer would fail on it with a TypeError.
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _BadRecord("a string holds an unpaired UTF-16 surrogate escape (such as \\ud800), which is "
                             "no Unicode character; write the character itself or a complete surrogate pair"
                             ) from None
    return record


def _read_jsonl(file: Path, bad: _BadRecords) -> Iterator[tuple[str, Any]]:
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
            except _BadRecord as err:
                bad.report(where, str(err))
                continue
            yield where, record


def _read_parquet(file: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(file).iter_batches(batch_size=_CHUNK)
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
    yield from _table_rows(folder, ds.with_format("arrow").iter(batch_size=_CHUNK))


def read_records(path: Path, fmt: str, bad: _BadRecords) -> Iterator[tuple[str, Any]]:
    """Every record of the source in file order, each with the place to name in errors."""
    for file in _data_files(path, fmt):
        if fmt == "jsonl":
            yield from _read_jsonl(file, bad)
        elif fmt == "parquet":
            yield from _read_parquet(file)
        else:
            yield from _read_arrow(file)


# ---------------------------------------------------------------------------------------------
# Validating: a record -> ("text", str) or ("chat", messages), or _BadRecord.

def _parse_text(record: dict, field: str) -> str:
    text = record.get(field)
    if text is None:
        raise _BadRecord(f"missing field '{field}' (the record has {sorted(record)}); set data.text_field "
                         "or data.messages_field if your field is named differently")
    if not isinstance(text, str):
        raise _BadRecord(f"field '{field}' must be a string, got {type(text).__name__}")
    if not text.strip():
        raise _BadRecord(f"field '{field}' is empty")
    return text


def _parse_message(i: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise _BadRecord(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
    for key in ("role", "content"):
        if message.get(key) is None:
            raise _BadRecord(f"messages[{i}] has no '{key}' (it has {sorted(message)}); each message needs "
                             "'role' and 'content'")
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise _BadRecord(f"messages[{i}] has unknown role {role!r} (expected one of {', '.join(ROLES)}; map "
                         "ShareGPT-style 'human'/'gpt' to 'user'/'assistant')")
    if not isinstance(content, str):
        raise _BadRecord(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
    if role == "assistant" and not content.strip():
        raise _BadRecord(f"messages[{i}] is an assistant message with empty content")
    # None-valued keys come from Arrow's struct columns; templates treat them as set.
    return {k: v for k, v in message.items() if v is not None}


def _parse_messages(record: dict, field: str) -> list[dict]:
    messages = record.get(field)
    if messages is None:
        raise _BadRecord(f"missing field '{field}' (the record has {sorted(record)}); set data.messages_field "
                         "if your field is named differently")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise _BadRecord(f"field '{field}' must be a non-empty list of {{role, content}} objects, got {got}")
    parsed = [_parse_message(i, m) for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in parsed):
        raise _BadRecord(f"field '{field}' has no assistant message, so nothing would be trained")
    return parsed


def parse_record(record: Any, cfg: DataConfig) -> tuple[str, Any]:
    if not isinstance(record, dict):
        raise _BadRecord(f"expected an object with a '{cfg.text_field}' or '{cfg.messages_field}' field, "
                         f"got {type(record).__name__}")
    kind = cfg.kind
    if kind == "auto":
        kind = "chat" if record.get(cfg.messages_field) is not None else "text"
    if kind == "chat":
        return "chat", _parse_messages(record, cfg.messages_field)
    return "text", _parse_text(record, cfg.text_field)


# ---------------------------------------------------------------------------------------------
# Tokenizing: a document is (token ids, trained flags); a trained token is a prediction target.

def _tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, verbose=False)["input_ids"]  # long texts are fine: packing cuts them
    return [x if x and x[-1] == eos else x + [eos] for x in ids]


def _not_verbatim(i: int) -> _BadRecord:
    return _BadRecord(f"messages[{i}]: the chat template does not render this content verbatim, so its "
                      "tokens cannot be located; use a chat template with {% generation %} markers")


def _end_marker(tokenizer, messages: list[dict]) -> str:
    """What the template writes after the last assistant content ('<|im_end|>' in ChatML), sans whitespace."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    content = messages[-1]["content"]
    at = rendered.rfind(content)
    if at < 0:
        raise _not_verbatim(len(messages) - 1)
    return rendered[at + len(content):].rstrip()


def _assistant_char_spans(tokenizer, messages: list[dict], rendered: str) -> list[tuple[int, int]]:
    """Character spans of assistant content + end marker, for templates without {% generation %}.

    Contents are found in message order (so an assistant reply that repeats the user's words is
    found in its own turn); the end marker comes from rendering the conversation up to that turn.
    This also works for templates that rewrite earlier turns (Qwen3 drops old <think> blocks), where
    rendering prefixes would not give prefixes of the whole conversation.
    """
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        start = rendered.find(message["content"], cursor)
        if start < 0:
            raise _not_verbatim(i)
        cursor = start + len(message["content"])
        if message["role"] == "assistant":
            marker = _end_marker(tokenizer, messages[: i + 1])
            if marker and rendered.startswith(marker, cursor):
                cursor += len(marker)
            spans.append((start, cursor))
    return spans


def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Chat-template tokens and, per token, whether it belongs to an assistant turn."""
    if _GENERATION_TAG.search(tokenizer.get_chat_template()):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_char_spans(tokenizer, messages, rendered)
    # The same call apply_chat_template(tokenize=True) makes, plus the offsets to map spans to tokens.
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    trained = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), trained


def _check_tokenizer(tokenizer, kinds: set[str], path: Path) -> None:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; set eos_token in its tokenizer_config.json")
    if "chat" in kinds:
        try:
            tokenizer.get_chat_template()
        except ValueError:
            raise DataError(f"{path} has chat records but the tokenizer has no chat template; use a tokenizer "
                            "folder with chat_template.jinja, or set data.kind: text") from None


@dataclass(frozen=True)
class Corpus:
    """All documents' tokens back to back; document d is tokens[offsets[d]:offsets[d+1]]."""

    tokens: np.ndarray  # [N_tokens] int32 (half the memory of int64; vocabularies fit)
    trained: np.ndarray  # [N_tokens] bool: the token is a prediction target
    offsets: np.ndarray  # [num_documents + 1] int64

    @classmethod
    def from_documents(cls, docs: list[tuple[list[int], list[bool]]]) -> Corpus:
        """Documents as (token ids, trained flags) pairs, in order."""
        lengths = np.array([len(ids) for ids, _ in docs], dtype=np.int64)
        return cls(tokens=np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in docs]),
                   trained=np.concatenate([np.asarray(mask, dtype=np.bool_) for _, mask in docs]),
                   offsets=np.concatenate([[0], np.cumsum(lengths)]))

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def piece(self, doc: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        base = int(self.offsets[doc])
        return self.tokens[base + start: base + end], self.trained[base + start: base + end]

    def subset(self, docs: np.ndarray) -> Corpus:
        """The documents `docs` (indices, kept in that order) as a corpus of their own."""
        pieces = [self.piece(d, 0, n) for d, n in zip(docs.tolist(), self.lengths[docs].tolist())]
        return Corpus.from_documents([(ids.tolist(), trained.tolist()) for ids, trained in pieces])


def split_eval(corpus: Corpus, fraction: float, seed: int) -> tuple[Corpus, Corpus]:
    """(training documents, held-out documents): round(fraction * N) documents, at least one, drawn by
    `seed`; both keep their file order. DataError when either side would be empty."""
    n = corpus.num_documents
    held = max(1, round(fraction * n))
    if held >= n:
        raise DataError(f"data.eval_fraction={fraction} of {n} documents leaves none to train on; lower it or "
                        "give a held-out file as data.eval")
    picked = np.zeros(n, dtype=bool)
    picked[np.random.default_rng([seed % 2**63, 1]).permutation(n)[:held]] = True
    return corpus.subset(np.flatnonzero(~picked)), corpus.subset(np.flatnonzero(picked))


Document = tuple[list[int], list[bool]]  # token ids, and per token whether it is a prediction target


def _has_labels(trained: list[bool]) -> bool:
    """Whether a document trains anything: labels are shifted, so its first token is never one."""
    return any(trained[1:])


def _tokenize_chat_record(tokenizer, messages: list[dict]) -> Document:
    """tokenize_chat, and _BadRecord for a conversation the template leaves nothing to train in."""
    ids, trained = tokenize_chat(tokenizer, messages)
    if not _has_labels(trained):
        raise _BadRecord("the chat template marks none of this conversation's tokens as assistant tokens, so "
                         "nothing would be trained; check the template's {% generation %} blocks")
    return ids, trained


def _tokenize_all(items: list[tuple[str, str, Any]], tokenizer,
                  bad: _BadRecords) -> list[tuple[str, Document]]:
    """(kind, document) in record order; texts in batches (fast tokenizers parallelize them), chats singly."""
    docs: list[tuple[str, Document] | None] = [None] * len(items)
    text_slots = [i for i, (_, kind, _) in enumerate(items) if kind == "text"]
    for lo in range(0, len(text_slots), _CHUNK):
        slots = text_slots[lo: lo + _CHUNK]
        for slot, ids in zip(slots, _tokenize_texts(tokenizer, [items[s][2] for s in slots])):
            docs[slot] = ("text", (ids, [True] * len(ids)))
    for slot, (where, kind, messages) in enumerate(items):
        if kind != "chat":
            continue
        try:
            docs[slot] = ("chat", _tokenize_chat_record(tokenizer, messages))
        except _BadRecord as err:
            bad.report(where, str(err))
        except jinja2.TemplateError as err:  # templates reject e.g. non-alternating roles this way
            bad.report(where, f"the chat template rejected the conversation: {err}")
    return [d for d in docs if d is not None]


@dataclass
class LoadStats:
    """What loading left out or changed; PackedLoader exposes the counts, the trainer logs them."""

    num_skipped: int = 0  # bad records skipped (data.skip_bad_records)
    num_chat_records: int = 0  # chat records tokenized, the overlong ones included
    num_overlong_dropped: int = 0  # chat records longer than seq_len that were removed
    num_overlong_truncated: int = 0  # chat records longer than seq_len kept as their first seq_len tokens
    shortest_dropped: int = 0  # tokens of the shortest dropped overlong record (0: none), for the hint

    @property
    def num_overlong(self) -> int:
        return self.num_overlong_dropped + self.num_overlong_truncated


def _fit_overlong(doc: Document, seq_len: int, policy: str) -> Document | None:
    """A chat document longer than seq_len -> its first seq_len tokens (truncate), or None (drop)."""
    if policy == "drop":
        return None
    ids, trained = doc[0][:seq_len], doc[1][:seq_len]
    # A prompt of seq_len tokens or more leaves no assistant token in the part kept: nothing to train.
    return (ids, trained) if _has_labels(trained) else None


def _apply_overlong(docs: list[tuple[str, Document]], seq_len: int, policy: str,
                    stats: LoadStats) -> list[Document]:
    """Chat documents made to fit one row (data.overlong), counted in stats; text documents unchanged."""
    kept = []
    for kind, doc in docs:
        # Text stays as it is: packing cuts it into seq_len chunks and every chunk trains every next token.
        if kind == "chat":
            stats.num_chat_records += 1
            length = len(doc[0])
            if length > seq_len:
                doc = _fit_overlong(doc, seq_len, policy)
                if doc is None:
                    stats.num_overlong_dropped += 1
                    stats.shortest_dropped = min(stats.shortest_dropped or length, length)
                    continue
                stats.num_overlong_truncated += 1
        kept.append(doc)
    return kept


def _log_overlong(path: Path, seq_len: int, policy: str, stats: LoadStats) -> None:
    if not stats.num_overlong:
        return
    head = (f"data: {stats.num_overlong} of {stats.num_chat_records} chat records in {path} are longer than "
            f"data.seq_len={seq_len}")
    if policy == "drop":
        log.warning("%s and were dropped (data.overlong: drop; set data.overlong: truncate to keep their "
                    "first %d tokens, or raise data.seq_len)", head, seq_len)
    else:
        log.warning("%s: data.overlong: truncate kept the first %d tokens of %d and dropped %d whose first "
                    "%d tokens hold no assistant token (raise data.seq_len to train them whole)",
                    head, seq_len, stats.num_overlong_truncated, stats.num_overlong_dropped, seq_len)


def _nothing_left(path: Path, seq_len: int, policy: str, stats: LoadStats) -> DataError:
    """The error for a source with no document left, naming why and what to change."""
    bad = f" ({stats.num_skipped} more skipped as bad)" if stats.num_skipped else ""
    if not stats.num_overlong_dropped:
        return DataError(f"{path}: no usable records ({stats.num_skipped} skipped as bad); check data.path, "
                         "data.kind and data.text_field / data.messages_field")
    why = ("data.overlong: drop removed them" if policy == "drop" else
           f"none has an assistant token in its first {seq_len} tokens, so data.overlong: truncate "
           "dropped them")
    fix = f"raise data.seq_len to at least {stats.shortest_dropped} (the shortest record)"
    if policy == "drop":
        fix += f", or set data.overlong: truncate to train their first {seq_len} tokens"
    return DataError(f"{path}: no record left: all {stats.num_overlong_dropped} chat records are longer than "
                     f"data.seq_len={seq_len} and {why}{bad}; {fix}")


def build_corpus(cfg: DataConfig, tokenizer) -> tuple[Corpus, LoadStats]:
    """Read, validate and tokenize the whole source -> (corpus, what was skipped, dropped or truncated).

    Raises DataError on a bad record (unless data.skip_bad_records) and when no document is left.
    """
    path = Path(cfg.path)
    if not path.exists():
        raise DataError(f"data.path {path} does not exist")
    fmt = detect_format(path) if cfg.format == "auto" else cfg.format
    bad = _BadRecords(cfg.skip_bad_records)
    items = []
    for where, record in read_records(path, fmt, bad):
        try:
            kind, payload = parse_record(record, cfg)
        except _BadRecord as err:
            bad.report(where, str(err))
            continue
        items.append((where, kind, payload))
    _check_tokenizer(tokenizer, {kind for _, kind, _ in items}, path)
    tokenized = _tokenize_all(items, tokenizer, bad)
    stats = LoadStats(num_skipped=bad.count)
    docs = _apply_overlong(tokenized, cfg.seq_len, cfg.overlong, stats)
    if bad.count:
        log.warning("skipped %d bad records in %s (data.skip_bad_records); the first: %s",
                    bad.count, path, bad.first)
    _log_overlong(path, cfg.seq_len, cfg.overlong, stats)
    if not docs:
        raise _nothing_left(path, cfg.seq_len, cfg.overlong, stats)
    return Corpus.from_documents(docs), stats


# ---------------------------------------------------------------------------------------------
# Packing and collating.

Row = list[tuple[int, int, int]]  # (document, start, end) pieces, at most seq_len tokens in all


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int) -> list[Row]:
    """Next-fit packing in document order; long documents become seq_len chunks."""
    rows: list[Row] = []
    row: Row = []
    used = 0
    for doc in order.tolist():
        n = int(lengths[doc])
        for start in range(0, n, seq_len):
            end = min(start + seq_len, n)
            if used + end - start > seq_len:
                rows.append(row)
                row, used = [], 0
            row.append((doc, start, end))
            used += end - start
    if row:
        rows.append(row)
    return rows


@dataclass
class Batch:
    """B packed rows of S tokens; see the module docstring for the meaning of every field."""

    input_ids: torch.Tensor  # [B, S] long
    labels: torch.Tensor  # [B, S] long, pre-shifted targets, -100 where nothing is predicted
    position_ids: torch.Tensor  # [B, S] long, restarting at each document
    cu_seqlens: torch.Tensor  # [num_docs + 1] int32 over the flattened B*S tokens
    max_seqlen: int
    num_label_tokens: int

    def to(self, device: torch.device | str) -> Batch:
        return Batch(input_ids=self.input_ids.to(device, non_blocking=True),
                     labels=self.labels.to(device, non_blocking=True),
                     position_ids=self.position_ids.to(device, non_blocking=True),
                     cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
                     max_seqlen=self.max_seqlen, num_label_tokens=self.num_label_tokens)


def collate(rows: list[Row], corpus: Corpus, seq_len: int, pad_id: int) -> Batch:
    input_ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((len(rows), seq_len), dtype=np.int64)
    seqlens = []
    for b, row in enumerate(rows):
        col = 0
        for doc, start, end in row:
            ids, trained = corpus.piece(doc, start, end)
            n = end - start
            input_ids[b, col: col + n] = ids
            # Position t predicts token t+1 of the same piece; the piece's last token predicts nothing.
            labels[b, col: col + n - 1] = np.where(trained[1:], ids[1:], IGNORE_INDEX)
            position_ids[b, col: col + n] = np.arange(n)
            seqlens.append(n)
            col += n
        if col < seq_len:  # padding is a document of its own, so attention never mixes it in
            position_ids[b, col:] = np.arange(seq_len - col)
            seqlens.append(seq_len - col)
    labels_t = torch.from_numpy(labels)
    return Batch(input_ids=torch.from_numpy(input_ids), labels=labels_t,
                 position_ids=torch.from_numpy(position_ids),
                 cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32),
                 max_seqlen=max(seqlens), num_label_tokens=int((labels_t != IGNORE_INDEX).sum()))


class PackedLoader:
    """Infinite iterator of this rank's Batches over the global packed-row stream; resumable."""

    def __init__(self, corpus: Corpus, seq_len: int, micro_batch_size: int, pad_id: int, seed: int,
                 shuffle: bool, dp_rank: int = 0, dp_world: int = 1, num_skipped: int = 0,
                 num_overlong_dropped: int = 0, num_overlong_truncated: int = 0):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world={dp_world})")
        self.corpus, self.seq_len, self.pad_id = corpus, seq_len, pad_id
        self.micro_batch_size, self.dp_rank, self.dp_world = micro_batch_size, dp_rank, dp_world
        self.seed, self.shuffle = seed, shuffle
        # What loading left out or cut (see LoadStats), for the trainer to log.
        self.num_skipped = num_skipped
        self.num_overlong_dropped, self.num_overlong_truncated = num_overlong_dropped, num_overlong_truncated
        self.epoch, self.row = 0, 0  # the next global row to hand out
        self._packed: tuple[int, list[Row]] | None = None
        self.held_out: Corpus | None = None  # data.eval_fraction's documents, never trained on

    @property
    def num_documents(self) -> int:
        return self.corpus.num_documents

    def epoch_rows(self, epoch: int) -> list[Row]:
        """The packed rows of one epoch (cached: only the current epoch is kept)."""
        if self._packed is None or self._packed[0] != epoch:
            n = self.corpus.num_documents
            # Seeding with (seed, epoch) rather than seed + epoch keeps different seeds' epochs apart.
            order = (np.random.default_rng([epoch, self.seed % 2**63]).permutation(n) if self.shuffle
                     else np.arange(n))
            self._packed = (epoch, pack_rows(self.corpus.lengths, order, self.seq_len))
        return self._packed[1]

    def _take_global_rows(self, count: int) -> list[Row]:
        rows: list[Row] = []
        while len(rows) < count:
            epoch_rows = self.epoch_rows(self.epoch)
            taken = epoch_rows[self.row: self.row + count - len(rows)]
            rows += taken
            self.row += len(taken)
            if self.row == len(epoch_rows):
                self.epoch, self.row = self.epoch + 1, 0
        return rows

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        rows = self._take_global_rows(self.dp_world * self.micro_batch_size)
        lo = self.dp_rank * self.micro_batch_size
        return collate(rows[lo: lo + self.micro_batch_size], self.corpus, self.seq_len, self.pad_id)

    def state_dict(self) -> dict[str, int]:
        # The same on every rank; the rest identifies the stream so a mismatched resume is caught.
        return {"epoch": self.epoch, "row": self.row, "seed": self.seed, "seq_len": self.seq_len,
                "num_documents": self.num_documents, "num_tokens": int(self.corpus.offsets[-1])}

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        changed = [k for k in ("seed", "seq_len", "num_documents", "num_tokens") if state.get(k) != mine[k]]
        if changed:
            then = {k: state.get(k) for k in changed}
            now = {k: mine[k] for k in changed}
            raise DataError(f"cannot resume the data position: {', '.join(changed)} changed since the checkpoint "
                            f"({then} -> {now}); resume with the same data, tokenizer, data.seq_len, "
                            "data.seed and data.overlong")
        self.epoch, self.row = int(state["epoch"]), int(state["row"])


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def build_dataloader(cfg: DataConfig, tokenizer, micro_batch_size: int, dp_rank: int = 0, dp_world: int = 1,
                     seed_offset: int = 0) -> PackedLoader:
    """The loader of data rank `dp_rank` of `dp_world`; `seed_offset` shifts data.seed. With
    data.eval_fraction the held-out documents are left out (and kept as `loader.held_out`)."""
    corpus, stats = build_corpus(cfg, tokenizer)
    held_out = None
    if cfg.eval_fraction > 0:
        corpus, held_out = split_eval(corpus, cfg.eval_fraction, cfg.seed)
        log.info("%s: %d documents held out for eval (data.eval_fraction=%g)", cfg.path, held_out.num_documents,
                 cfg.eval_fraction)
    pad_id = _pad_id(tokenizer)
    loader = PackedLoader(corpus, cfg.seq_len, micro_batch_size, pad_id, cfg.seed + seed_offset, cfg.shuffle,
                          dp_rank=dp_rank, dp_world=dp_world, num_skipped=stats.num_skipped,
                          num_overlong_dropped=stats.num_overlong_dropped,
                          num_overlong_truncated=stats.num_overlong_truncated)
    loader.held_out = held_out
    log.info("%s: %d documents, %d tokens, %d packed rows of %d in epoch 0", cfg.path, corpus.num_documents,
             int(corpus.offsets[-1]), len(loader.epoch_rows(0)), cfg.seq_len)
    return loader


def eval_batches(cfg: DataConfig, tokenizer, micro_batch_size: int, held_out: Corpus | None = None,
                 dp_rank: int = 0, dp_world: int = 1) -> list[Batch]:
    """This data rank's eval batches (see the module docstring): the held-out documents of a training
    loader, or data.eval read as data.path is."""
    if held_out is None:
        held_out, _ = build_corpus(cfg.model_copy(update={"path": cfg.eval}), tokenizer)
    rows = pack_rows(held_out.lengths, np.arange(held_out.num_documents), cfg.seq_len)
    per_step = dp_world * micro_batch_size
    batches = []
    for first in range(0, len(rows), per_step):
        mine = rows[first + dp_rank * micro_batch_size: first + (dp_rank + 1) * micro_batch_size]
        mine += [[] for _ in range(micro_batch_size - len(mine))]  # label-less padding rows
        batches.append(collate(mine, held_out, cfg.seq_len, _pad_id(tokenizer)))
    return batches

"""The corpus: every record tokenized, overlong chat records dropped or truncated (data.overlong), all
documents' tokens back to back; the held-out split of data.eval_fraction (see runtime.data)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from runtime.config import DataConfig
from runtime.data.chat import check_tokenizer, tokenize_chat, tokenize_texts
from runtime.data.formats import (
    CHUNK,
    BadRecord,
    BadRecords,
    DataError,
    detect_format,
    parse_record,
    read_records,
)

log = logging.getLogger("runtime.data")


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
    """tokenize_chat, and BadRecord for a conversation the template leaves nothing to train in."""
    ids, trained = tokenize_chat(tokenizer, messages)
    if not _has_labels(trained):
        raise BadRecord("the chat template marks none of this conversation's tokens as assistant tokens, so "
                        "nothing would be trained; check the template's {% generation %} blocks")
    return ids, trained


def _tokenize_all(items: list[tuple[str, str, Any]], tokenizer,
                  bad: BadRecords) -> list[tuple[str, Document]]:
    """(kind, document) in record order; texts in batches (fast tokenizers parallelize them), chats singly."""
    docs: list[tuple[str, Document] | None] = [None] * len(items)
    text_slots = [i for i, (_, kind, _) in enumerate(items) if kind == "text"]
    for lo in range(0, len(text_slots), CHUNK):
        slots = text_slots[lo: lo + CHUNK]
        for slot, ids in zip(slots, tokenize_texts(tokenizer, [items[s][2] for s in slots])):
            docs[slot] = ("text", (ids, [True] * len(ids)))
    for slot, (where, kind, messages) in enumerate(items):
        if kind != "chat":
            continue
        try:
            docs[slot] = ("chat", _tokenize_chat_record(tokenizer, messages))
        except BadRecord as err:
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
    bad = BadRecords(cfg.skip_bad_records)
    items = []
    for where, record in read_records(path, fmt, bad):
        try:
            kind, payload = parse_record(record, cfg)
        except BadRecord as err:
            bad.report(where, str(err))
            continue
        items.append((where, kind, payload))
    check_tokenizer(tokenizer, {kind for _, kind, _ in items}, path)
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

"""runtime.data: sources, chat masking, packing invariants, determinism, dp slicing, resume, bad records,
chat records longer than seq_len (data.overlong).

All offline, on the tiny example's tokenizer and data (examples/tiny/).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import logging
from pathlib import Path

import pytest
import torch

from runtime.config import DataConfig
from runtime.data.chat import load_tokenizer, tokenize_chat
from runtime.data.corpus import build_corpus
from runtime.data.formats import DataError
from runtime.data.loader import build_dataloader
from runtime.data.packing import Batch

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny"
IM_END = "<|im_end|>"

CHATS = [
    [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Repeat after me: good morning"},
     {"role": "assistant", "content": "good morning"},  # also appears in the user turn
     {"role": "user", "content": "Spell the word cat."},
     {"role": "assistant", "content": "c-a-t"}],
    [{"role": "user", "content": "Count from 3 to 6."}, {"role": "assistant", "content": "3 4 5 6"},
     {"role": "user", "content": "What color is the sky?"}],  # ends on a user turn: nothing after it trained
]
TEXTS = ["Anna has 3 apples. Anna eats one apple.", "We count: one, two, three.", "The cat sat on the mat."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY / "tokenizer")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def data_cfg(path, **kw) -> DataConfig:
    kw.setdefault("seq_len", 64)
    return DataConfig(path=str(path), tokenizer=str(TINY / "tokenizer"), **kw)


def mixed_records() -> list[dict]:
    return [{"messages": m} for m in CHATS] + [{"text": t} for t in TEXTS]


def segments(batch: Batch) -> list[tuple[int, int]]:
    cu = batch.cu_seqlens.tolist()
    return list(itertools.pairwise(cu))


def documents(batch: Batch, pad_id: int) -> list[tuple[int, int]]:
    """The segments that are documents, not row padding."""
    ids = batch.input_ids.flatten()
    return [(s, e) for s, e in segments(batch) if not (ids[s:e] == pad_id).all()]


def all_rows(loader) -> Batch:
    """Epoch 0 in one batch: a fresh loader's batch of as many rows as the epoch has."""
    loader.micro_batch_size = len(loader.epoch_rows(0))
    return next(loader)


def assert_packing_invariants(batch: Batch, seq_len: int, pad_id: int) -> None:
    B, S = batch.input_ids.shape
    assert S == seq_len and batch.labels.shape == batch.position_ids.shape == (B, S)
    assert batch.input_ids.dtype == batch.labels.dtype == batch.position_ids.dtype == torch.long
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens[-1] == B * S
    ids, labels, pos = batch.input_ids.flatten(), batch.labels.flatten(), batch.position_ids.flatten()
    segs = segments(batch)
    starts = {s for s, _ in segs}
    assert all(b * S in starts for b in range(B)), "a document crosses a row boundary"
    for s, e in segs:
        assert torch.equal(pos[s:e], torch.arange(e - s)), "position_ids do not restart at the document start"
        assert labels[e - 1] == -100, "the last token of a document predicts into the next one"
        inner = labels[s:e - 1]
        hit = inner != -100
        assert torch.equal(inner[hit], ids[s + 1:e][hit]), "a label is not the next token of its document"
    # Every position where position_ids is 0 starts a segment, so no layer needs cu_seqlens to agree.
    assert starts == set((pos == 0).nonzero().flatten().tolist())
    assert batch.max_seqlen == max(e - s for s, e in segs)
    assert batch.num_label_tokens == int((labels != -100).sum())
    assert (batch.labels[batch.input_ids == pad_id] == -100).all()


# --- sources -----------------------------------------------------------------------------------

def test_jsonl_parquet_and_save_to_disk_give_the_same_documents(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = mixed_records()
    write_jsonl(tmp_path / "d.jsonl", records)
    # Mixed records in one table: text rows have a null messages column and vice versa.
    table = pa.Table.from_struct_array(pa.array(records))
    pq.write_table(table, tmp_path / "d.parquet")
    datasets.Dataset.from_dict(table.to_pydict()).save_to_disk(str(tmp_path / "saved"))
    corpora = [build_corpus(data_cfg(tmp_path / name), tok)[0] for name in ("d.jsonl", "d.parquet", "saved")]
    for corpus in corpora:
        assert corpus.num_documents == len(records)
        assert (corpus.tokens == corpora[0].tokens).all() and (corpus.trained == corpora[0].trained).all()


def test_folder_of_jsonl_files_reads_them_in_name_order(tmp_path, tok):
    folder = tmp_path / "parts"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", [{"text": TEXTS[1]}])
    write_jsonl(folder / "a.jsonl", [{"text": TEXTS[0]}])
    corpus, _ = build_corpus(data_cfg(folder, shuffle=False), tok)
    first = corpus.piece(0, 0, int(corpus.lengths[0]))[0]
    assert tok.decode(first) == TEXTS[0] + IM_END


def test_format_errors_say_what_to_set(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        build_corpus(data_cfg(tmp_path / "nope.jsonl"), tok)
    (tmp_path / "d.txt").write_text("hi\n")
    with pytest.raises(DataError, match="set data.format"):
        build_corpus(data_cfg(tmp_path / "d.txt"), tok)
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "no-tokenizer")


# --- tokenization and labels --------------------------------------------------------------------

def test_text_documents_train_every_next_token(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    batch = all_rows(build_dataloader(data_cfg(path, shuffle=False, seq_len=128), tok, 1))
    for (s, e), text in zip(documents(batch, tok.pad_token_id), TEXTS, strict=True):
        ids, labels = batch.input_ids.flatten()[s:e], batch.labels.flatten()[s:e]
        assert tok.decode(ids) == text + IM_END
        assert torch.equal(labels[:-1], ids[1:]) and labels[-1] == -100


def test_chat_labels_are_exactly_the_assistant_turns(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    batch = all_rows(build_dataloader(data_cfg(path, shuffle=False, seq_len=256), tok, 1))
    for (s, e), messages in zip(documents(batch, tok.pad_token_id), CHATS, strict=True):
        ids, labels = batch.input_ids.flatten()[s:e], batch.labels.flatten()[s:e]
        assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
        expected = "".join(m["content"] + IM_END for m in messages if m["role"] == "assistant")
        assert tok.decode(labels[labels != -100]) == expected


def test_chat_spans_without_generation_markers_match_the_template_mask(tok):
    plain = load_tokenizer(TINY / "tokenizer")
    plain.chat_template = tok.get_chat_template().replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", "")
    assert "generation %}" not in plain.get_chat_template()
    lines = (TINY / "data" / "train.jsonl").read_text().splitlines()[:200]
    for messages in CHATS + [json.loads(line)["messages"] for line in lines]:
        assert tokenize_chat(plain, messages) == tokenize_chat(tok, messages)


# --- packing ------------------------------------------------------------------------------------

# At 32 about half the conversations are longer than seq_len: dropped, or truncated to 32 tokens.
@pytest.mark.parametrize("seq_len,overlong", [(32, "drop"), (32, "truncate"), (256, "drop")])
def test_packing_invariants_on_the_tiny_dataset(tok, seq_len, overlong):
    cfg = data_cfg(TINY / "data" / "train.jsonl", seq_len=seq_len, overlong=overlong)
    loader = build_dataloader(cfg, tok, 8)
    for _ in range(3):
        assert_packing_invariants(next(loader), seq_len, tok.pad_token_id)
    # One epoch holds every token of every document exactly once; a chat is never cut into chunks.
    pieces = sorted(p for row in loader.epoch_rows(0) for p in row)
    assert sum(e - s for _, s, e in pieces) == int(loader.corpus.lengths.sum())
    assert all(s == 0 and e == loader.corpus.lengths[d] <= seq_len for d, s, e in pieces)
    assert all(sum(e - s for _, s, e in row) <= seq_len for row in loader.epoch_rows(0))


def test_a_long_document_becomes_chunks_with_their_own_positions(tmp_path, tok):
    text = " ".join(["The cat sat on the mat."] * 20)
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": text}])
    loader = build_dataloader(data_cfg(path, seq_len=16), tok, 1)
    n = int(loader.corpus.lengths[0])
    batch = all_rows(loader)
    assert batch.input_ids.shape[0] == -(-n // 16)
    assert_packing_invariants(batch, 16, tok.pad_token_id)
    assert tok.decode(batch.input_ids.flatten()[:n]) == text + IM_END
    assert (batch.labels.flatten()[n:] == -100).all() and (batch.input_ids.flatten()[n:] == tok.pad_token_id).all()


# --- determinism, data parallelism, resume ------------------------------------------------------

def tiny_loader(tok, micro_batch_size=4, **kw):
    """The tiny text set in rows of 512: about 80 rows an epoch, so a few dozen batches cross epochs."""
    cfg_kw = {k: kw.pop(k) for k in ("seed", "shuffle") if k in kw}
    return build_dataloader(data_cfg(TINY / "data" / "text.jsonl", seq_len=512, **cfg_kw), tok,
                            micro_batch_size, **kw)


def take(loader, n) -> list[Batch]:
    return [next(loader) for _ in range(n)]


def same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "labels", "position_ids",
                                                                   "cu_seqlens"))


def test_shuffling_is_deterministic_by_seed_and_changes_per_epoch(tok):
    a, b, other = tiny_loader(tok, seed=1), tiny_loader(tok, seed=1), tiny_loader(tok, seed=2)
    assert all(same(x, y) for x, y in zip(take(a, 3), take(b, 3)))
    assert not same(next(tiny_loader(tok, seed=1)), next(other))
    assert a.epoch_rows(0) != a.epoch_rows(1)
    unshuffled = tiny_loader(tok, shuffle=False)
    assert unshuffled.epoch_rows(0) == unshuffled.epoch_rows(1)


def test_dp_ranks_split_the_single_process_batch(tok):
    world, per_rank, steps = 3, 2, 30  # 30 steps of 6 rows cross the epoch boundary (~79 rows)
    single = tiny_loader(tok, micro_batch_size=world * per_rank, seed=5)
    ranks = [tiny_loader(tok, micro_batch_size=per_rank, seed=5, dp_rank=r, dp_world=world) for r in range(world)]
    for _ in range(steps):
        whole, parts = next(single), [next(r) for r in ranks]
        for field in ("input_ids", "labels", "position_ids"):
            assert torch.equal(getattr(whole, field), torch.cat([getattr(p, field) for p in parts]))
        assert whole.num_label_tokens == sum(p.num_label_tokens for p in parts)
    assert single.epoch >= 1
    assert all(r.state_dict() == single.state_dict() for r in ranks)


def test_resume_from_state_dict_sees_the_uninterrupted_batches(tok):
    reference = take(tiny_loader(tok), 50)  # crosses into epoch 1
    interrupted = tiny_loader(tok)
    take(interrupted, 37)
    state = interrupted.state_dict()
    resumed = tiny_loader(tok)
    resumed.load_state_dict(state)
    assert all(same(x, y) for x, y in zip(take(resumed, 13), reference[37:]))
    # The position is global: ranks of a 2-way run resume from a single-process checkpoint too.
    halves = [tiny_loader(tok, micro_batch_size=2, dp_rank=r, dp_world=2) for r in range(2)]
    for half in halves:
        half.load_state_dict(state)
    parts = [next(h) for h in halves]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), reference[37].input_ids)


def test_resume_with_other_data_is_refused(tok):
    state = tiny_loader(tok, seed=1).state_dict()
    with pytest.raises(DataError, match="seed changed since the checkpoint"):
        tiny_loader(tok, seed=2).load_state_dict(state)


# --- chat records longer than seq_len (data.overlong) ---------------------------------------------

LONG_PROMPT = " ".join(["The cat sat on the mat."] * 40)  # about 240 tokens


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def short_and_overlong(tmp_path, num_long=4) -> Path:
    """40 tiny conversations (at most 95 tokens each) and num_long whose prompt alone is longer than 96."""
    lines = (TINY / "data" / "train.jsonl").read_text().splitlines()[:40]
    records = [json.loads(line) for line in lines]
    for i in range(num_long):
        records.insert(7 * i + 3, chat(f"{i}: {LONG_PROMPT}", "ok"))
    return write_jsonl(tmp_path / "long.jsonl", records)


def test_overlong_chats_are_dropped_counted_and_logged_once(tmp_path, tok, caplog):
    # Chunked, a long prompt made rows of prompt only: at micro_batch_size 1, steps with no label token.
    path = short_and_overlong(tmp_path)
    with caplog.at_level(logging.WARNING, logger="runtime.data"):
        loader = build_dataloader(data_cfg(path, seq_len=96), tok, 1)
    assert (loader.num_overlong_dropped, loader.num_overlong_truncated, loader.num_documents) == (4, 0, 40)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = (f"data: 4 of 44 chat records in {path} are longer than data.seq_len=96 and were dropped "
                "(data.overlong: drop; set data.overlong: truncate to keep their first 96 tokens, or raise "
                "data.seq_len)")
    assert warnings == [expected]
    for _ in range(2 * len(loader.epoch_rows(0))):  # two epochs, one row per step
        batch = next(loader)
        assert batch.num_label_tokens > 0
        assert_packing_invariants(batch, 96, tok.pad_token_id)


def test_truncate_keeps_the_first_seq_len_tokens(tmp_path, tok, caplog):
    long_reply = chat("Tell me about the cat.", LONG_PROMPT)  # its first 64 tokens hold assistant tokens
    long_prompt = chat(LONG_PROMPT, "ok")  # its first 64 tokens are prompt only: dropped, nothing to train
    path = write_jsonl(tmp_path / "c.jsonl", [long_reply, long_prompt, {"messages": CHATS[0]}])
    with caplog.at_level(logging.WARNING, logger="runtime.data"):
        loader = build_dataloader(data_cfg(path, shuffle=False, overlong="truncate"), tok, 1)
    assert (loader.num_overlong_dropped, loader.num_overlong_truncated, loader.num_documents) == (1, 1, 2)
    assert "data.overlong: truncate kept the first 64 tokens of 1 and dropped 1" in caplog.text
    ids, trained = tokenize_chat(tok, long_reply["messages"])
    assert len(ids) > 64
    first = next(loader)  # the truncated conversation fills row 0 alone
    assert first.input_ids[0].tolist() == ids[:64]
    expected = [i if t else -100 for i, t in zip(ids[1:64], trained[1:64])] + [-100]
    assert first.labels[0].tolist() == expected and first.num_label_tokens > 0
    assert_packing_invariants(first, 64, tok.pad_token_id)
    second = next(loader)
    assert tok.decode(second.input_ids[0][second.position_ids[0] == torch.arange(64)]).startswith(
        tok.apply_chat_template(CHATS[0], tokenize=False))


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_a_source_with_every_record_overlong_is_an_error(tmp_path, tok, overlong):
    path = write_jsonl(tmp_path / "long.jsonl", [chat(LONG_PROMPT, "ok"), chat("x " + LONG_PROMPT, "ok")])
    n = len(tokenize_chat(tok, chat(LONG_PROMPT, "ok")["messages"])[0])
    with pytest.raises(DataError, match=rf"long\.jsonl: no record left: all 2 chat records are longer than "
                                        rf"data\.seq_len=64 .*; raise data\.seq_len to at least {n} "):
        build_corpus(data_cfg(path, overlong=overlong), tok)


def stream_digest(loader, num_batches: int) -> str:
    digest = hashlib.sha256()
    for _ in range(num_batches):
        batch = next(loader)
        for t in (batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens):
            digest.update(t.numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_a_stream_without_overlong_records_is_unchanged(tmp_path, tok, overlong):
    """Chats that fit and texts cut into chunks: exactly the stream of the code before data.overlong."""
    lines = (TINY / "data" / "train.jsonl").read_text().splitlines()[:300]  # at most 95 tokens each
    records = [json.loads(line) for line in lines] + [{"text": LONG_PROMPT}] * 3
    loader = build_dataloader(data_cfg(write_jsonl(tmp_path / "d.jsonl", records), seq_len=96,
                                       overlong=overlong), tok, 2)
    assert (loader.num_overlong_dropped, loader.num_overlong_truncated, loader.num_skipped) == (0, 0, 0)
    assert len(loader.epoch_rows(0)) == 157
    # Recorded with the loader of commit 1c62425 (83 steps: into epoch 1).
    assert stream_digest(loader, 83) == "327b93776065969da3b1d41f52985eee1567a62623638125589ccdd648506f06"
    assert (loader.epoch, loader.row) == (1, 9)


def test_resume_under_another_overlong_policy_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS] + [chat("Go on.", LONG_PROMPT)])
    state = build_dataloader(data_cfg(path), tok, 1).state_dict()
    truncating = build_dataloader(data_cfg(path, overlong="truncate"), tok, 1)
    with pytest.raises(DataError, match=r"num_documents, num_tokens changed .* data\.overlong"):
        truncating.load_state_dict(state)


# --- bad records --------------------------------------------------------------------------------

GOOD = {"messages": CHATS[0]}
BAD_RECORDS = [
    ('{"text": "unterminated', "invalid JSON"),
    ({"prompt": "hi"}, "missing field 'text'"),
    ({"text": ""}, "field 'text' is empty"),
    ({"text": 5}, "field 'text' must be a string, got int"),
    ({"messages": "hello"}, "field 'messages' must be a non-empty list of {role, content} objects, got str"),
    ({"messages": ["hello"]}, r"messages\[0\] must be an object with 'role' and 'content'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] has no 'content'"),
    ({"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\] has unknown role 'human'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "field 'messages' has no assistant message"),
    # Python's json raises RecursionError / ValueError on these: no traceback, a bad record.
    ('{"text": "half a pair \\ud800 here"}', "a string holds an unpaired UTF-16 surrogate escape"),
    ("[" * 100_000, r"invalid JSON \(nested too deeply\)"),
    ('{"text": "x", "n": ' + "9" * 5000 + "}", r"invalid JSON \(Exceeds the limit \(4300 digits\)"),
]


@pytest.mark.parametrize("bad,problem", BAD_RECORDS, ids=[p.split()[0] for _, p in BAD_RECORDS])
def test_a_bad_jsonl_record_names_file_line_problem_and_fix(tmp_path, tok, bad, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", bad, GOOD])  # the blank line 2 is no record
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: {problem}.*set data.skip_bad_records: true"):
        build_corpus(data_cfg(path), tok)


def test_a_bad_parquet_row_names_its_row(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "fine"}, {"text": ""}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: row 1 \(0-based\): field 'text' is empty"):
        build_corpus(data_cfg(tmp_path / "bad.parquet"), tok)


def test_a_corrupt_parquet_page_is_a_data_error(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"row {i} " * 20} for i in range(5000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet", compression="snappy", row_group_size=500)
    data = bytearray((tmp_path / "p.parquet").read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)  # the footer is intact: the file opens
    (tmp_path / "bad.parquet").write_bytes(data)
    with pytest.raises(DataError, match=r"bad\.parquet: the rows from row \d+ \(0-based\) on cannot be read .*"
                                        r"the file is corrupt"):
        build_corpus(data_cfg(tmp_path / "bad.parquet"), tok)


def test_a_conversation_the_chat_template_rejects_is_a_bad_record(tmp_path):
    strict = load_tokenizer(TINY / "tokenizer")
    strict.chat_template = ("{%- if messages[0].role != 'user' %}{{ raise_exception('start with a user turn') }}"
                            "{%- endif %}" + strict.get_chat_template())
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[1]}])
    with pytest.raises(DataError, match=r"c\.jsonl:2: the chat template rejected the conversation: start with"):
        build_corpus(data_cfg(path), strict)


def test_a_chat_the_template_marks_nothing_of_is_a_bad_record(tmp_path):
    untrained = load_tokenizer(TINY / "tokenizer")
    untrained.chat_template = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
                               "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                               "{%- generation %}{%- endgeneration %}")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: the chat template marks none of this conversation's"):
        build_corpus(data_cfg(path), untrained)


def test_a_byte_order_mark_starts_no_record(tmp_path, tok):
    path = tmp_path / "bom.jsonl"
    lines = [json.dumps({"text": TEXTS[0]}), json.dumps({"messages": CHATS[0]})]
    path.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    corpus, _ = build_corpus(data_cfg(path, shuffle=False), tok)
    assert corpus.num_documents == 2
    assert tok.decode(corpus.piece(0, 0, int(corpus.lengths[0]))[0]) == TEXTS[0] + IM_END


def test_skip_bad_records_counts_and_warns_once(tmp_path, tok, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD] + [bad for bad, _ in BAD_RECORDS] + [{"text": "ok"}])
    with caplog.at_level(logging.WARNING, logger="runtime.data"):
        loader = build_dataloader(data_cfg(path, skip_bad_records=True), tok, 2)
    assert loader.num_skipped == len(BAD_RECORDS) and loader.num_documents == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"skipped {len(BAD_RECORDS)} bad records" in warnings[0].getMessage()
    assert_packing_invariants(next(loader), 64, tok.pad_token_id)


def test_nothing_left_after_skipping_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": ""}, {"prompt": "x"}])
    with pytest.raises(DataError, match=r"no usable records \(2 skipped as bad\)"):
        build_corpus(data_cfg(path, skip_bad_records=True), tok)


# --- the tiny example's assets ------------------------------------------------------------------

def test_tiny_assets_are_small_and_regenerate_identically(tmp_path):
    committed = {p.relative_to(TINY): p.read_bytes() for d in ("data", "tokenizer")
                 for p in sorted((TINY / d).rglob("*")) if p.is_file()}
    assert sum(len(b) for b in committed.values()) < 2 * 2**20
    spec = importlib.util.spec_from_file_location("build_assets", TINY / "build_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    rebuilt = {p.relative_to(tmp_path): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert rebuilt == committed

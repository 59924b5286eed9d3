"""Training data: read records, tokenize them, pack documents into fixed-length rows, batch them.

    formats.py  reading and validating records      chat.py     tokenizer, chat templates
    corpus.py   tokenized documents, overlong, split packing.py  rows and Batch
    loader.py   PackedLoader (resumable), eval_batches

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
A batch padded to a CUDA graph's static shapes (runtime.graph_step.static_batch) carries empty documents at the
end of cu_seqlens, a max_seqlen above its longest document, and label_bound: the loss's row count above
num_label_tokens (which stays the true count the loss divides by).

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

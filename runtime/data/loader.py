"""The loaders: this data rank's infinite, resumable stream of training Batches, and its eval batches
(see runtime.data)."""

from __future__ import annotations

import logging

import numpy as np

from runtime.config import DataConfig
from runtime.data.corpus import Corpus, build_corpus, split_eval
from runtime.data.formats import DataError
from runtime.data.packing import Batch, Row, collate, pack_rows

log = logging.getLogger("runtime.data")


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

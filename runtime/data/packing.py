"""Packing documents into rows of seq_len tokens and collating rows into a Batch (see runtime.data)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.device import to_device_async
from runtime.data.corpus import Corpus
from runtime.loss import IGNORE_INDEX

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
    label_bound: int | None = None  # rows the loss visits when above num_label_tokens (runtime.graph_step)

    @property
    def loss_rows(self) -> int:
        """The loss's row count: the label count, or the bound a graphed step holds static (runtime.loss)."""
        return self.num_label_tokens if self.label_bound is None else self.label_bound

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`, copied without the host waiting (gpu.device.to_device_async)."""
        return Batch(input_ids=to_device_async(self.input_ids, device), labels=to_device_async(self.labels, device),
                     position_ids=to_device_async(self.position_ids, device),
                     cu_seqlens=to_device_async(self.cu_seqlens, device), max_seqlen=self.max_seqlen,
                     num_label_tokens=self.num_label_tokens, label_bound=self.label_bound)


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

"""Context parallelism inside the token mixers: one rank's share of rows split along the sequence, and the
exchanges that let attention and Gated DeltaNet layers compute exactly what they compute on whole rows.

Layout (zigzag, load-balanced for causal attention): every row of S tokens is cut into 2*cp equal pieces;
cp rank r holds pieces r and 2*cp-1-r, in that order (S_loc = S / cp tokens). A rank's early piece has
few keys to attend to and its late piece many, so every rank does the same attention work.

    shard = CPShard(group, rank, size, meta)         # meta: the AttnMeta of the WHOLE rows (built once)
    local_BS = shard.take(t_BS)                      # this rank's tokens of a whole-row tensor
    x_BShF = seq_to_heads(x_BSHF, shard)             # [B, S_loc, H, F] -> [B, S, H/cp, F], whole rows, heads of this rank
    y_BSHF = heads_to_seq(y_BShF, shard)             # the inverse
    k_BSKD = gather_sequence(k_BSKD, shard)          # [B, S_loc, ...] -> [B, S, ...] in row order (all-gather)

Every exchange is a functional collective with autograd (its backward is the reverse exchange) that
torch.compile traces. Attention modes (`parallelism.cp_attention`):
    allgather  K and V gathered over the cp group; each rank attends with its own queries. Where the whole rows'
               metadata is for the varlen kernel (backend flash: CUDA), one varlen call over VarlenSegments (this
               rank's queries cut at document and piece ends, each with its document's keys up to its last query);
               elsewhere SDPA with a [B, 1, S_loc, S] mask from the documents and the zigzag positions
    ulysses    q, k, v exchanged from sequence to heads (all-to-all), the ordinary backend over the whole
               rows and their metadata, the output exchanged back; needs q heads divisible by cp and kv
               heads dividing or divisible by cp (kv heads are repeated up to cp)
GDN modes (`parallelism.cp_gdn`, attention/gdn.py):
    heads      head-parallel: the ulysses exchange, conv and delta rule per head over whole rows; needs
               linear_num_key_heads divisible by cp
    state      state passing: each rank runs its own pieces, with every piece's conv tail and recurrent-state
               transition exchanged by all-gather (gather_pieces); any cp, either op set
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

CP_ATTENTION_MODES = ("allgather", "ulysses")
CP_GDN_MODES = ("heads", "state")
# renamed in torch 2.13; the GPU image's torch 2.11 has only the old name
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def zigzag_pieces(size: int, rank: int) -> tuple[int, int]:
    """The pieces (of 2*size per row) cp rank `rank` holds, in its local order."""
    return rank, 2 * size - 1 - rank


def zigzag_index(seq_len: int, size: int, rank: int, device=None) -> torch.Tensor:
    """Row positions of cp rank `rank`'s tokens, in its local order: pieces rank and 2*size-1-rank."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallelism cuts every row into 2*cp = {2 * size} equal pieces, but rows have "
                         f"{seq_len} tokens; set data.seq_len to a multiple of {2 * size}")
    piece = seq_len // (2 * size)
    return torch.cat([torch.arange(p * piece, (p + 1) * piece, device=device) for p in zigzag_pieces(size, rank)])


def _row_order(seq_len: int, size: int, device) -> torch.Tensor:
    """For every row position, its place in the concatenation of all ranks' local tokens (rank major)."""
    concat = torch.cat([zigzag_index(seq_len, size, r, device) for r in range(size)])
    return torch.empty_like(concat).scatter_(0, concat, torch.arange(concat.numel(), device=device))


@dataclass(frozen=True)
class VarlenSegments:
    """allgather mode on a varlen kernel: this rank's queries cut wherever a document or a zigzag piece ends.
    Segment i holds the local queries cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1 of the flattened [B*S_loc] (local
    order, so q needs no reordering) and attends to the keys key_index_T[cu_seqlens_k[i] .. cu_seqlens_k[i+1]-1],
    positions in the flattened whole rows [B*S]: one contiguous run from its document's start to its last query.
    It has at least as many keys as queries and its last query sees its last key, so causal attention over it
    is aligned bottom-right (FlashAttention-2's alignment when seqlen_q < seqlen_k)."""
    cu_seqlens_q: torch.Tensor  # int32 [segments + 1]
    cu_seqlens_k: torch.Tensor  # int32 [segments + 1]
    key_index_T: torch.Tensor  # int64 [cu_seqlens_k[-1]]
    max_seqlen_q: int
    max_seqlen_k: int


def zigzag_segments(doc_bounds: list[int], batch: int, seq_len: int, size: int,
                    rank: int) -> list[tuple[int, int, int]]:
    """(first query, first key, end) of every segment of cp rank `rank`, in its local query order; positions in
    the flattened whole rows [B*S]: queries first query .. end-1, keys first key (its document's start) .. end-1.
    doc_bounds: the sorted document boundaries over the flattened rows, every row start and B*S among them."""
    piece = seq_len // (2 * size)
    segments = []
    for b, p in itertools.product(range(batch), zigzag_pieces(size, rank)):
        start, end = b * seq_len + p * piece, b * seq_len + (p + 1) * piece
        d = bisect.bisect_right(doc_bounds, start) - 1  # the document holding the piece's first token
        while doc_bounds[d] < end:
            doc_start, doc_end = doc_bounds[d], doc_bounds[d + 1]
            segments.append((max(start, doc_start), doc_start, min(end, doc_end)))
            d += 1
    return segments


def varlen_segments(doc_bounds: list[int], batch: int, seq_len: int, size: int, rank: int,
                    device) -> VarlenSegments:
    """zigzag_segments as the varlen kernel's tables on `device`: built from host ints, then copied once."""
    segments = zigzag_segments(doc_bounds, batch, seq_len, size, rank)
    q_lens = [end - first_q for first_q, _, end in segments]
    k_lens = [end - first_k for _, first_k, end in segments]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32) for lens in (q_lens, k_lens))
    # segment i's keys are first_k_i + (0 .. k_len_i - 1): one arange over the packed keys, shifted per segment
    shift_T = torch.repeat_interleave(torch.tensor([k for _, k, _ in segments]) - cu_k[:-1], torch.tensor(k_lens))
    key_index_T = shift_T + torch.arange(sum(k_lens))
    return VarlenSegments(cu_q.to(device), cu_k.to(device), key_index_T.to(device), max(q_lens), max(k_lens))


def piece_documents(doc_bounds: list[int], batch: int, seq_len: int, num_pieces: int, pieces: tuple[int, ...],
                    back: int = 0) -> tuple[list[int], list[bool]]:
    """(cu_seqlens, continues) of `pieces` (of num_pieces per row) as batch*len(pieces) rows, batch-major, each
    of seq_len/num_pieces tokens plus the `back` tokens before it (before a row start: zeros, one document).
    cu_seqlens: document boundaries over those rows flattened, every row start among them; continues: whether
    each piece's first token continues a document begun before it. doc_bounds as in zigzag_segments."""
    piece = seq_len // num_pieces
    width = piece + back
    starts = set(doc_bounds)
    cu, continues = [], []
    for i, (b, p) in enumerate(itertools.product(range(batch), pieces)):
        begin = b * seq_len + p * piece - back  # flattened position of the extended piece's first token
        lo = bisect.bisect_left(doc_bounds, max(begin, b * seq_len))
        hi = bisect.bisect_left(doc_bounds, begin + width)
        cu += [i * width, *(i * width + c - begin for c in doc_bounds[lo:hi] if c > begin)]
        continues.append(begin + back not in starts)
    return [*cu, len(continues) * width], continues


@dataclass
class CPShard:
    """This rank's share of a batch of whole rows, and what the mixers need to compute over whole rows.

    meta: the whole rows' attention metadata (attention.attention.AttnMeta: packed mask, cu_seqlens, whether it is
    for the varlen kernel); mode: the attention exchange; position_ids_BS: the whole rows' positions (documents
    restart at 0); gdn_mode: how GDN layers split (CP_GDN_MODES). allgather mode holds either `segments` (meta for
    the varlen kernel) or `mask_B1sS`. gdn_mode state also needs gdn_conv_tail, the GDN conv window minus one: the
    tokens each piece's conv reads from its predecessor."""
    group: dist.ProcessGroup
    rank: int
    size: int
    meta: object
    position_ids_BS: torch.Tensor
    mode: str = "allgather"
    gdn_mode: str = "heads"
    gdn_conv_tail: int = 0
    index_S: torch.Tensor = field(init=False)
    row_order_S: torch.Tensor = field(init=False)
    segments: VarlenSegments | None = field(init=False)
    mask_B1sS: torch.Tensor | None = field(init=False)
    pieces_2: torch.Tensor | None = field(init=False)  # this rank's pieces (gdn_mode state)
    piece_order_P: torch.Tensor | None = field(init=False)  # gathered pieces, rank-major -> piece order (state)
    # this rank's pieces as 2B rows (batch-major, local order; gdn_mode state): the delta rule's documents, the
    # conv's over the pieces extended back by gdn_conv_tail tokens, and which pieces continue a document
    piece_cu_seqlens: torch.Tensor | None = field(init=False)
    conv_cu_seqlens: torch.Tensor | None = field(init=False)
    continues_n: torch.Tensor | None = field(init=False)

    def __post_init__(self):
        if self.mode not in CP_ATTENTION_MODES:
            raise ValueError(f"unknown cp attention mode {self.mode!r}; choose one of {CP_ATTENTION_MODES}")
        if self.gdn_mode not in CP_GDN_MODES:
            raise ValueError(f"unknown cp GDN mode {self.gdn_mode!r}; choose one of {CP_GDN_MODES}")
        B, S = self.position_ids_BS.shape
        device = self.position_ids_BS.device
        self.index_S = zigzag_index(S, self.size, self.rank, device)
        self.row_order_S = _row_order(S, self.size, device)
        # built once per batch, shared by every attention layer; the varlen kernel needs no [B, 1, S_loc, S] mask
        varlen, allgather = self.meta.varlen, self.mode == "allgather"
        self.segments = (varlen_segments(self._document_bounds(), B, S, self.size, self.rank, device)
                         if allgather and varlen else None)
        self.mask_B1sS = self._attention_mask() if allgather and not varlen else None
        # index tensors of the state-passing exchanges, made once per batch rather than in every GDN layer
        self.pieces_2 = self.piece_order_P = self.piece_cu_seqlens = self.conv_cu_seqlens = self.continues_n = None
        if self.gdn_mode == "state":
            rank_major = [p for r in range(self.size) for p in zigzag_pieces(self.size, r)]
            self.pieces_2 = torch.tensor(self.pieces, device=device)
            self.piece_order_P = torch.tensor([rank_major.index(p) for p in range(2 * self.size)], device=device)
            bounds = self._document_bounds()
            cu, continues = piece_documents(bounds, B, S, 2 * self.size, self.pieces)
            conv_cu, _ = piece_documents(bounds, B, S, 2 * self.size, self.pieces, self.gdn_conv_tail)
            self.piece_cu_seqlens, self.conv_cu_seqlens = (torch.tensor(c, dtype=torch.int32, device=device)
                                                           for c in (cu, conv_cu))
            self.continues_n = torch.tensor(continues, device=device)

    @property
    def seq_len(self) -> int:
        return self.position_ids_BS.shape[1]

    @property
    def pieces(self) -> tuple[int, int]:
        """The zigzag pieces this rank holds, in its local order."""
        return zigzag_pieces(self.size, self.rank)

    def take(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a whole-row tensor [B, S, ...] -> [B, S_loc, ...]."""
        return t_BS.index_select(1, self.index_S)

    def _document_bounds(self) -> list[int]:
        """The whole rows' document boundaries over the flattened B*S tokens, every row start among them: host
        ints read from meta.cu_seqlens once per batch (None: one document per row)."""
        B, S = self.position_ids_BS.shape
        cu = [] if self.meta.cu_seqlens is None else self.meta.cu_seqlens.tolist()
        return sorted(set(cu) | set(range(0, B * S + 1, S)))

    def _attention_mask(self) -> torch.Tensor:
        """allgather mode: local query i sees row key j iff j <= pos(i) and both lie in one document."""
        doc_BS = torch.cumsum((self.position_ids_BS == 0).to(torch.int32), dim=-1)
        q_pos_s = self.index_S
        k_pos_S = torch.arange(self.seq_len, device=q_pos_s.device)
        causal_sS = k_pos_S.unsqueeze(0) <= q_pos_s.unsqueeze(1)
        same_doc_BsS = self.take(doc_BS).unsqueeze(-1) == doc_BS.unsqueeze(-2)
        return (same_doc_BsS & causal_sS).unsqueeze(1)


def _to_row_order(concat_B_S: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """[B, cp*S_loc, ...] rank-major concatenation -> [B, S, ...] in row order."""
    return concat_B_S.index_select(1, shard.row_order_S)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: NCCL's reduce-scatter (an all-gather's backward)
    refuses strided input, and a transposed view's gradient is strided (gloo copies it silently)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's x stacked along dim 0, differentiable (backward reduce-scatters a contiguous gradient)."""
    return _ContiguousGrad.apply(_all_gather_autograd(x.contiguous(), 0, group))


def gather_sequence(x_BsF: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """All ranks' tokens in row order: [B, S_loc, ...] -> [B, S, ...]; backward reduce-scatters."""
    gathered = _all_gather(x_BsF.transpose(0, 1), shard.group)
    return _to_row_order(gathered.transpose(0, 1), shard)


def gather_pieces(x_2F: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """Every piece's value in piece order: [2, ...] (this rank's pieces, local order) -> [2*cp, ...]; backward
    reduce-scatters."""
    if shard.size == 1:  # one rank holds both pieces: nothing to exchange (a single-device run of the state path)
        return x_2F
    gathered = _all_gather(x_2F, shard.group)  # rank r's pieces at 2r, 2r+1
    return gathered.index_select(0, shard.piece_order_P)


def seq_to_heads(x_BsHF: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """[B, S_loc, H, F] -> [B, S, H/cp, F]: whole rows, heads rank*H/cp .. (rank+1)*H/cp - 1."""
    B, s, H, F = x_BsHF.shape
    if H % shard.size:
        raise ValueError(f"{H} heads do not split over cp={shard.size}")
    # [cp (destination), s, B, H/cp, F]: each rank receives its head group of every rank's tokens
    send = x_BsHF.view(B, s, shard.size, H // shard.size, F).permute(2, 1, 0, 3, 4).contiguous()
    received = funcol.all_to_all_single_autograd(send.flatten(0, 1), None, None, shard.group)
    concat = received.view(shard.size * s, B, H // shard.size, F).transpose(0, 1)  # rank-major tokens
    return _to_row_order(concat, shard)


def heads_to_seq(y_BShF: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """The inverse of seq_to_heads: [B, S, H/cp, F] -> [B, S_loc, H, F]."""
    B, S, h, F = y_BShF.shape
    s = S // shard.size
    # back to rank-major token order: the tokens each rank sent, in the order it sent them
    concat = y_BShF.index_select(1, _rank_major(shard))
    send = concat.transpose(0, 1).contiguous()  # [cp * s, B, h, F]: block r goes back to rank r
    received = funcol.all_to_all_single_autograd(send, None, None, shard.group)
    # [cp (source head group), s, B, h, F] -> [B, s, cp * h, F]
    return received.view(shard.size, s, B, h, F).permute(2, 1, 0, 3, 4).reshape(B, s, shard.size * h, F)


def _rank_major(shard: CPShard) -> torch.Tensor:
    """Row positions in rank-major order (rank 0's tokens, then rank 1's, ...)."""
    return torch.cat([zigzag_index(shard.seq_len, shard.size, r, shard.index_S.device) for r in range(shard.size)])


def repeat_kv_for_cp(k_BsKD: torch.Tensor, q_heads: int, size: int) -> torch.Tensor:
    """KV heads made divisible by cp for the head exchange: repeated (GQA grouping kept) when cp is a
    multiple of their count; errors name the head counts otherwise."""
    kv_heads = k_BsKD.shape[2]
    if q_heads % size:
        raise ValueError(f"cp_attention: ulysses splits the {q_heads} query heads over cp={size}, which does not "
                         "divide them; use parallelism.cp_attention: allgather or another cp")
    if kv_heads % size == 0:
        return k_BsKD
    if size % kv_heads:
        raise ValueError(f"cp_attention: ulysses needs the {kv_heads} kv heads to divide cp={size} or be divisible "
                         "by it; use parallelism.cp_attention: allgather or another cp")
    return k_BsKD.repeat_interleave(size // kv_heads, dim=2)

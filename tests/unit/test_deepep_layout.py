"""The deepep dispatcher's pure conversions (moe/dispatch/deepep.py) on the CPU, against loops written
from DeepEP's kernels and from the all_to_all dispatcher's semantics; and its refusal without deep_ep.

Shapes: T tokens, k top-k, E experts, R ep ranks, M rows one rank receives. The kernels themselves
(and the dispatcher end to end) run in tests/gpu/test_deepep_gpu.py.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import yaml

from moe.dispatch import DISPATCHERS
from moe.dispatch import deepep as dd

HAVE_DEEP_EP = importlib.util.find_spec("deep_ep") is not None
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"


def routing(T: int, k: int, E: int, seed: int, p_none: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per token (some slots -1 with probability p_none) and positive weights."""
    gen = torch.Generator().manual_seed(seed)
    ids_Tk = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    ids_Tk = torch.where(torch.rand(T, k, generator=gen) < p_none, -1, ids_Tk)
    return ids_Tk, torch.rand(T, k, generator=gen) + 0.1


# ---------------------------------------------------------------------------- torch statements of DeepEP's kernels

def dispatch_layout(topk_ids_Tk: torch.Tensor, num_experts: int, ep: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What deep_ep.Buffer.get_dispatch_layout computes, in torch: (num_tokens_per_rank [R] int32,
    num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool). A -1 id selects nothing."""
    T = topk_ids_Tk.shape[0]
    valid_Tk = topk_ids_Tk >= 0
    ids_Tk = topk_ids_Tk.long()
    per_expert_E = torch.bincount(ids_Tk[valid_Tk], minlength=num_experts)
    # -1 slots land in an extra column R, dropped after
    owner_Tk = torch.where(valid_Tk, ids_Tk // (num_experts // ep), ep)
    in_rank_TR = torch.zeros(T, ep + 1, dtype=torch.bool, device=ids_Tk.device).scatter_(1, owner_Tk, True)[:, :ep]
    return in_rank_TR.sum(0).to(torch.int32), per_expert_E.to(torch.int32), in_rank_TR.contiguous()


def sent_slots(topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor, dest_rank: int, num_local_experts: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (ids, weights) a token's k slots carry to `dest_rank` (DeepEP's sender, intranode.cu): the
    destination's local id where it owns the slot's expert, else -1 with weight 0."""
    local_Tk = topk_ids_Tk - dest_rank * num_local_experts
    owned_Tk = (topk_ids_Tk >= 0) & (local_Tk >= 0) & (local_Tk < num_local_experts)
    return torch.where(owned_Tk, local_Tk, -1), torch.where(owned_Tk, topk_w_Tk, torch.zeros_like(topk_w_Tk))


def tokens_per_local_expert(expert_ids_Mk: torch.Tensor, num_local_experts: int) -> list[int]:
    """Valid slots per local expert (DeepEP's num_recv_tokens_per_expert_list, expert_alignment 1)."""
    ids_S = expert_ids_Mk.reshape(-1)
    return torch.bincount(ids_S[ids_S >= 0].long(), minlength=num_local_experts).tolist()


def loop_layout(ids_Tk: torch.Tensor, E: int, R: int):
    """get_dispatch_layout as a loop over tokens and slots."""
    per_rank, per_expert = [0] * R, [0] * E
    in_rank = [[False] * R for _ in range(ids_Tk.shape[0])]
    for t, row in enumerate(ids_Tk.tolist()):
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t][e // (E // R)] = True
        for r in range(R):
            per_rank[r] += in_rank[t][r]
    return per_rank, per_expert, in_rank


CASES = [(0, 2, 8, 2, 0.0), (1, 1, 8, 2, 0.0), (13, 3, 8, 2, 0.0), (17, 2, 8, 4, 0.3), (64, 8, 128, 4, 0.0),
         (33, 8, 64, 8, 0.5), (9, 4, 16, 4, 1.0)]  # (T, k, E, R, share of -1 slots)


@pytest.mark.parametrize("T,k,E,R,p_none", CASES)
def test_dispatch_layout_matches_a_loop(T, k, E, R, p_none):
    ids_Tk, _ = routing(T, k, E, seed=T + k, p_none=p_none)
    per_rank_R, per_expert_E, in_rank_TR = dispatch_layout(ids_Tk, E, R)
    ref_rank, ref_expert, ref_in_rank = loop_layout(ids_Tk, E, R)
    assert per_rank_R.dtype == per_expert_E.dtype == torch.int32 and in_rank_TR.dtype == torch.bool
    assert in_rank_TR.shape == (T, R) and in_rank_TR.is_contiguous()
    assert per_rank_R.tolist() == ref_rank and per_expert_E.tolist() == ref_expert
    assert in_rank_TR.tolist() == ref_in_rank


@pytest.mark.parametrize("T,k,E,R,p_none", CASES)
def test_received_rows_equal_the_all_to_all_layout(T, k, E, R, p_none):
    """What a rank receives under DeepEP's layout (its sender's slot rewrite, rows grouped by source,
    each source's in token order) equals AllToAllDispatcher's rows and local ids; the weights equal
    on valid slots and are 0 on -1 slots (all_to_all keeps the weight there: both are ignored)."""
    from moe.dispatch.all_to_all import AllToAllDispatcher

    a2a = AllToAllDispatcher.__new__(AllToAllDispatcher)  # only its id remapping: no group needed
    a2a.num_local_experts = E // R
    per_source = [routing(T + s, k, E, seed=100 * s + T, p_none=p_none) for s in range(R)]
    for rank in range(R):
        ids, ws, a2a_ids, a2a_ws = [], [], [], []
        for src_ids_Tk, src_w_Tk in per_source:
            _, _, in_rank_TR = dispatch_layout(src_ids_Tk, E, R)
            rows = in_rank_TR[:, rank].nonzero().squeeze(-1)  # token order
            i, w = sent_slots(src_ids_Tk[rows], src_w_Tk[rows], rank, E // R)
            ids.append(i)
            ws.append(w)
            a2a_ids.append(a2a._local_ids(src_ids_Tk[rows], torch.full((len(rows),), rank)))
            a2a_ws.append(src_w_Tk[rows])
        ids_Mk, w_Mk, ref_ids_Mk, ref_w_Mk = (torch.cat(x) for x in (ids, ws, a2a_ids, a2a_ws))
        assert torch.equal(ids_Mk, ref_ids_Mk)
        valid = ids_Mk >= 0
        assert torch.equal(w_Mk[valid], ref_w_Mk[valid]) and bool((w_Mk[~valid] == 0).all())
        # every received row has at least one slot for this rank
        assert bool(valid.any(-1).all())
        # DeepEP's per-local-expert counts of this rank: slots of each of its experts over all sources
        counts = tokens_per_local_expert(ids_Mk, E // R)
        ref = [sum(int((s_ids == rank * (E // R) + e).sum()) for s_ids, _ in per_source) for e in range(E // R)]
        assert counts == ref


def test_sent_slots_against_a_loop():
    ids_Tk, w_Tk = routing(11, 3, 12, seed=3, p_none=0.2)
    for dest in range(3):
        got_ids, got_w = sent_slots(ids_Tk, w_Tk, dest, 4)
        for t in range(11):
            for j in range(3):
                e = int(ids_Tk[t, j])
                mine = e >= 0 and e // 4 == dest
                assert int(got_ids[t, j]) == (e - 4 * dest if mine else -1)
                assert float(got_w[t, j]) == (float(w_Tk[t, j]) if mine else 0.0)


def test_source_splits_and_row_sources():
    # rank_prefix_matrix[s, r]: rows sources 0..s sent to r (running totals down each column)
    sent_SR = torch.tensor([[3, 0, 2], [1, 4, 0], [0, 2, 5]])
    prefix_RR = sent_SR.cumsum(0).to(torch.int32)
    for r in range(3):
        assert dd.source_splits(prefix_RR, r) == sent_SR[:, r].tolist()
    src_idx_M = torch.tensor([5, 8, 0, 1, 2, 3, 6], dtype=torch.int32)  # rank 2 receives 2 + 0 + 5 rows
    src_rank_M, src_tok_M = dd.row_sources(prefix_RR, src_idx_M, 2)
    assert src_rank_M.tolist() == [0, 0, 2, 2, 2, 2, 2]
    assert src_tok_M.dtype == torch.int64 and src_tok_M.tolist() == src_idx_M.tolist()


def test_routing_dtypes_to_deepep_and_back():
    ids_Tk = torch.tensor([[3, -1], [0, 5]], dtype=torch.int32)
    w_Tk = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.bfloat16).t()  # not contiguous
    ids_d, w_d = dd.to_deepep_routing(ids_Tk, w_Tk)
    assert ids_d.dtype == torch.int64 and w_d.dtype == torch.float32
    assert ids_d.is_contiguous() and w_d.is_contiguous()
    assert torch.equal(ids_d, ids_Tk.long()) and torch.equal(w_d, w_Tk.float())
    assert dd.to_deepep_routing(ids_Tk, w_Tk, torch.int32)[0].dtype == torch.int32  # TOPK_IDX_BITS=32 builds
    back_ids, back_w = ids_d.to(torch.int32), w_d.to(torch.bfloat16)  # what dispatch returns: lossless
    assert back_ids.dtype == torch.int32 and back_w.dtype == torch.bfloat16
    assert torch.equal(back_ids, ids_Tk) and torch.equal(back_w, w_Tk)


class _FakeConfig:
    """A deep_ep.Config stand-in: its NVLink size hint, as csrc/config.hpp computes it (intranode)."""

    def __init__(self, num_sms: int, recv_tokens: int):
        self.num_sms, self.recv_tokens = num_sms, recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels = self.num_sms // 2
        per_token = hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4
        n = channels * num_ranks * (2 + 3) * 4 + channels * num_ranks * self.recv_tokens * per_token
        return (n + 127) // 128 * 128


def test_buffer_sizing():
    assert dd.row_bytes(2048, 2) == 4096 and dd.row_bytes(2048, 4) == 8192 and dd.row_bytes(2048, 1) == 4096
    small, large = _FakeConfig(20, 128), _FakeConfig(20, 256)
    n = dd.nvl_bytes((small, large), dd.row_bytes(2048, 2), 4)
    assert n == large.get_nvl_buffer_size_hint(4096, 4) and n % 128 == 0
    # The ring holds recv_tokens rows per (channel, rank): independent of the tokens per rank.
    assert 60e6 < n < 70e6  # Qwen3-30B-A3B rows, ep 4: ~63 MB


def test_shape_checks_name_the_limit():
    dd.check_deepep_shapes(4, 128, 2048, 2, 8)
    with pytest.raises(ValueError, match=r"groups of \[2, 4, 8\] ranks.*has 3: use all_to_all"):
        dd.check_deepep_shapes(3, 12)
    with pytest.raises(ValueError, match="num_experts=10 is not divisible by the EP group size 4"):
        dd.check_deepep_shapes(4, 10)
    with pytest.raises(ValueError, match="2048 experts per rank, DeepEP takes at most 1024"):
        dd.check_deepep_shapes(2, 4096)
    with pytest.raises(ValueError, match="top-k 33"):
        dd.check_deepep_shapes(2, 64, k=33)
    with pytest.raises(ValueError, match="16-byte units"):
        dd.check_deepep_shapes(2, 64, 100, 2, 8)
    dd.check_deepep_shapes(2, 64, 100, 4, 8)  # 400 bytes: fp32 rows of 100 are fine


@pytest.mark.skipif(HAVE_DEEP_EP, reason="deep_ep is installed here")
def test_registry_refuses_deepep_without_the_package():
    assert "deepep" in DISPATCHERS.names()
    assert re.search(r"the deep_ep package is not installed.*benchmarks/build_deepep.sh.*use all_to_all",
                     DISPATCHERS.unavailable_reason("deepep", "cuda"))
    assert dd.deepep_unavailable_reason() is not None
    with pytest.raises(ImportError, match="benchmarks/build_deepep.sh"):
        dd.import_deep_ep()


@pytest.mark.skipif(HAVE_DEEP_EP, reason="deep_ep is installed here")
def test_plan_refuses_deepep_naming_the_build_script():
    from runtime.config import ConfigError, config_from_dict
    from runtime.plan import plan

    raw = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    raw["parallelism"] = {"dispatcher": "deepep"}
    with pytest.raises(ConfigError) as err:
        plan(config_from_dict(raw, base_dir=EXAMPLE.parent), 1, "cuda")
    assert "parallelism.dispatcher: deepep cannot run here: the deep_ep package is not installed" in str(err.value)
    assert "benchmarks/build_deepep.sh" in str(err.value)


def test_deepep_module_imports_without_deep_ep():
    """The runtime imports moe.dispatch.deepep everywhere; it must not import deep_ep (or CUDA) itself."""
    import sys

    assert "deep_ep" not in sys.modules or HAVE_DEEP_EP


# ---------------------------------------------------------------------------- the dispatcher over a fake deep_ep

class _FakeEvent:
    def current_stream_wait(self) -> None:
        pass


class _FakeBuffer:
    """deep_ep.Buffer's intranode API (commit 567632d) over gloo, written from its docstrings and
    kernels with loops: layout, dispatch with the sender's slot rewrite (local id, or -1 with weight 0),
    rows grouped by source in token order, cached dispatch by handle, and combine (a plain sum, bf16
    only, as DeepEP's kernels). Records what it was asked, for the checks."""

    num_sms = 20
    made: ClassVar[list[_FakeBuffer]] = []

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 explicitly_destroy: bool = False, **_):
        import torch.distributed as dist

        assert num_nvl_bytes > 0 and num_nvl_bytes % 128 == 0 and num_rdma_bytes == 0 and not low_latency_mode
        self.group, self.rank, self.R = group, group.rank(), group.size()
        self.num_nvl_bytes, self.destroyed, self.explicitly_destroy = num_nvl_bytes, False, explicitly_destroy
        dist.barrier(group)  # made collectively, as the real one (IPC handles all-gathered)
        _FakeBuffer.made.append(self)

    @staticmethod
    def set_num_sms(n: int) -> None:
        assert n % 2 == 0
        _FakeBuffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _FakeConfig:
        return _FakeConfig(_FakeBuffer.num_sms, 256)

    @staticmethod
    def get_combine_config(num_ranks: int) -> _FakeConfig:
        return _FakeConfig(_FakeBuffer.num_sms, 256)

    def destroy(self) -> None:
        assert self.explicitly_destroy and not self.destroyed
        self.destroyed = True

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert topk_idx.dtype == torch.int64 and topk_idx.is_contiguous() and not self.destroyed
        per_rank, per_expert, in_rank = loop_layout(topk_idx, num_experts, self.R)
        return (torch.tensor(per_rank, dtype=torch.int32), None, torch.tensor(per_expert, dtype=torch.int32),
                torch.tensor(in_rank, dtype=torch.bool).reshape(-1, self.R), _FakeEvent())

    def _exchange(self, rows: list[torch.Tensor], recv_counts: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        send = torch.cat(rows)
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(out, send, recv_counts, [len(r) for r in rows], group=self.group)
        return out

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        import torch.distributed as dist

        assert x.is_contiguous() and x.shape[1] * x.element_size() % 16 == 0 and not self.destroyed
        assert config is not None and num_worst_tokens == 0
        if handle is not None:  # cached: x only, the layout of the dispatch that made the handle
            assert topk_idx is None and topk_weights is None and config.num_sms == handle[1]
            rpm, _, _, _, _, send_tokens = handle
            recv = rpm[:, self.rank].tolist()
            recv = [b - a for a, b in zip([0, *recv[:-1]], recv, strict=True)]
            return self._exchange([x[t] for t in send_tokens], recv), None, None, None, None, _FakeEvent()
        assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
        assert topk_idx.is_contiguous() and topk_weights.is_contiguous()
        E, k = num_tokens_per_expert.shape[0], topk_idx.shape[1]
        E_local = E // self.R
        send_tokens, send_ids, send_w = [], [], []
        for dest in range(self.R):
            tokens = [t for t in range(x.shape[0]) if bool(is_token_in_rank[t, dest])]
            ids = [[int(topk_idx[t, j]) - dest * E_local if 0 <= int(topk_idx[t, j]) - dest * E_local < E_local
                    else -1 for j in range(k)] for t in tokens]
            w = [[float(topk_weights[t, j]) if ids[i][j] >= 0 else 0.0 for j in range(k)] for i, t in enumerate(tokens)]
            send_tokens.append(torch.tensor(tokens, dtype=torch.long))
            send_ids.append(torch.tensor(ids, dtype=torch.int64).reshape(-1, k))
            send_w.append(torch.tensor(w, dtype=torch.float32).reshape(-1, k))
        sent = torch.tensor([len(t) for t in send_tokens])
        sent_all = [torch.zeros_like(sent) for _ in range(self.R)]
        dist.all_gather(sent_all, sent, group=self.group)
        rpm = torch.stack(sent_all).cumsum(0).to(torch.int32)  # [source, dest] running over sources
        recv = [int(s[self.rank]) for s in sent_all]
        recv_x = self._exchange([x[t] for t in send_tokens], recv)
        recv_ids = self._exchange(send_ids, recv)
        recv_w = self._exchange(send_w, recv)
        src_idx = self._exchange([t.to(torch.int32) for t in send_tokens], recv)
        counts = [int((recv_ids == e).sum()) for e in range(E_local)]
        handle = (rpm, config.num_sms, None, src_idx, is_token_in_rank, send_tokens)
        return recv_x, recv_ids, recv_w, counts, handle, _FakeEvent()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        assert x.dtype == torch.bfloat16, "DeepEP's combine kernels exist for bf16 only"
        assert x.is_contiguous() and config is not None and config.num_sms == handle[1] and not self.destroyed
        rpm, _, _, _, in_rank, send_tokens = handle
        ends = rpm[:, self.rank].tolist()
        starts = [0, *ends[:-1]]
        back = self._exchange([x[a:b] for a, b in zip(starts, ends, strict=True)], [len(t) for t in send_tokens])
        tokens = torch.cat(send_tokens)
        out = torch.zeros(in_rank.shape[0], x.shape[1]).index_add_(0, tokens, back.float()).to(torch.bfloat16)
        w = None
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
            back_w = self._exchange([topk_weights[a:b] for a, b in zip(starts, ends, strict=True)],
                                    [len(t) for t in send_tokens])
            w = torch.zeros(in_rank.shape[0], topk_weights.shape[1]).index_add_(0, tokens, back_w)
        return out, w, _FakeEvent()


def _fake_deep_ep():
    import types

    module = types.ModuleType("deep_ep")
    module.Buffer, module.topk_idx_t = _FakeBuffer, torch.int64
    return module


def _check_fake(rank: int, ep: int) -> list[int]:
    """DeepEPDispatcher over the fake deep_ep vs one process with every expert (LocalDispatcher)."""
    import sys

    import torch.distributed as dist

    from moe.backends import expert_backend
    from moe.dispatch import LocalDispatcher
    from moe.experts import GroupedExperts

    sys.modules["deep_ep"] = _fake_deep_ep()
    H, I, E, k = 16, 8, 8, 3
    dispatcher = dd.DeepEPDispatcher(dist.group.WORLD, E, num_sms=8)
    assert _FakeBuffer.num_sms == 20  # the class default is left as found
    made = []
    for seed, counts in enumerate(([5, 7, 4, 6], [6, 0, 5, 4])):  # the second: rank 1 has no tokens
        counts = counts[:ep]
        N = sum(counts)
        starts = [sum(counts[:r]) for r in range(ep + 1)]
        mine = slice(starts[rank], starts[rank + 1])
        ids_Nk, _ = routing(N, k, E, seed=seed, p_none=0.0)
        gen = torch.Generator().manual_seed(seed)
        x_NH, w_Nk, g_NH = torch.randn(N, H, generator=gen), torch.rand(N, k, generator=gen) + 0.1, torch.randn(N, H)
        torch.manual_seed(seed)
        full = GroupedExperts(E, H, I)
        with torch.no_grad():
            full.gate_up.normal_(std=H ** -0.5)
            full.down.normal_(std=I ** -0.5)
        part = GroupedExperts(E // ep, H, I, expert_offset=rank * (E // ep))
        with torch.no_grad():
            part.gate_up.copy_(full.gate_up[rank * (E // ep):(rank + 1) * (E // ep)])
            part.down.copy_(full.down[rank * (E // ep):(rank + 1) * (E // ep)])
        results = []
        for disp, experts, sl in ((LocalDispatcher(), full, slice(None)), (dispatcher, part, mine)):
            x, w = x_NH[sl].clone().requires_grad_(), w_Nk[sl].clone().requires_grad_()
            routed = disp.dispatch(x, ids_Nk[sl], w)
            y = expert_backend("eager")(routed.x_MH, routed.expert_ids_Mk, routed.weights_Mk, experts)
            out = disp.combine(y, routed)
            ((x + out) * g_NH[sl]).sum().backward()
            results.append((out.detach(), x.grad, w.grad, experts.gate_up.grad, experts.down.grad))
            if disp is dispatcher:
                assert routed.weights_Mk.dtype == w.dtype and routed.expert_ids_Mk.dtype == ids_Nk.dtype
                assert routed.tokens_per_expert == tokens_per_local_expert(routed.expert_ids_Mk, E // ep)
                assert routed.valid_slots == int((routed.expert_ids_Mk >= 0).sum())
                src_rank, src_tok = routed.sources()
                assert torch.equal(routed.x_MH.detach(), x_NH[torch.tensor(starts)[src_rank] + src_tok])
        ref, got = results
        experts_of_rank = slice(rank * (E // ep), (rank + 1) * (E // ep))
        for name, a, b in zip(("out", "grad x", "grad w", "grad gate_up", "grad down"), got,
                              (ref[0][mine], ref[1][mine], ref[2][mine], ref[3][experts_of_rank],
                               ref[4][experts_of_rank]), strict=True):
            err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
            assert err <= 1e-2, f"ep={ep} rank {rank} seed {seed}: {name} norm-relative error {err:.1e}"
        made.append(len(_FakeBuffer.made))
    assert made == [1, 1], "one buffer, made on the first dispatch and reused"
    dispatcher.close()
    assert _FakeBuffer.made[0].destroyed and dispatcher.buffer is None
    return routed.recv_splits


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatcher_over_a_fake_deep_ep(world_size):
    """The autograd wiring (dispatch's backward = combine by handle, combine's = cached dispatch), dtype
    conversions, buffer lifecycle and Routed fields, over gloo with a torch stand-in for deep_ep's
    kernels. Says nothing about the real kernels: tests/gpu/test_deepep_gpu.py does."""
    from tests.dist.conftest import run_dist_processes

    splits = run_dist_processes(_check_fake, world_size)  # [rank] -> rows from each source, last case
    assert all(len(s) == world_size for s in splits)
    assert all(s[1] == 0 for s in splits)  # rank 1 had no tokens in the last case

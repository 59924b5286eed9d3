"""The router's selection modes: forced balanced routing (benchmarks) against the plain top-k."""

from __future__ import annotations

import torch

from moe.router import SoftmaxTopKRouter, balanced_ids


def _router(E=8, k=2, norm=True, **kw):
    torch.manual_seed(0)
    return SoftmaxTopKRouter(16, E, k, norm, **kw)


def test_balanced_ids_give_every_expert_the_same_count_and_distinct_ids_per_token():
    for E, k, T in [(8, 2, 64), (8, 3, 40), (16, 4, 48), (6, 6, 12)]:
        ids = balanced_ids(T, E, k)
        assert ids.shape == (T, k)
        assert all(len(set(row.tolist())) == k for row in ids)
        counts = torch.bincount(ids.flatten(), minlength=E)
        assert (counts == T * k // E).all(), (E, k, counts)
    counts = torch.bincount(balanced_ids(13, 8, 2).flatten(), minlength=8)  # T not a multiple of E
    assert int(counts.max() - counts.min()) <= 2


def test_balanced_ids_spread_a_token_over_the_ep_ranks():
    # E=8, k=2: stride 4 puts a token's experts in both halves (ep=2 ranks) rather than on one.
    ids = balanced_ids(8, 8, 2)
    assert ((ids[:, 0] < 4) != (ids[:, 1] < 4)).all()


def test_forced_balanced_weights_are_the_router_probs_at_the_ids_and_grads_reach_the_router():
    for norm in (True, False):
        router = _router(norm=norm, force_balanced=True)
        x = torch.randn(32, 16)
        out = router(x)
        assert torch.equal(out.topk_ids_Tk, balanced_ids(32, 8, 2))
        probs = torch.softmax(x @ router.weight.T, dim=-1)
        expected = probs.gather(1, out.topk_ids_Tk)
        if norm:
            expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(out.topk_w_Tk, expected)
        (out.topk_w_Tk * torch.randn_like(out.topk_w_Tk)).sum().backward()
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_forced_balanced_ignores_the_router_but_keeps_its_aux_loss():
    router = _router(force_balanced=True, aux_loss_coef=0.01)
    x = torch.randn(32, 16)
    first = router(x)
    with torch.no_grad():
        router.weight.mul_(-3)
    second = router(x)
    assert torch.equal(first.topk_ids_Tk, second.topk_ids_Tk)
    assert first.aux_loss is not None and first.aux_loss.requires_grad
    plain = _router()(x).topk_ids_Tk
    assert not torch.equal(plain, first.topk_ids_Tk)  # the pattern is not what the top-k picks


def test_bias_moves_by_rate_times_sign_toward_the_mean_load():
    router = _router(bias_update_rate=0.01)
    assert router.e_score_correction_bias.dtype == torch.float32 and not router.e_score_correction_bias.any()
    counts = torch.tensor([10, 2, 6, 6, 6, 6, 6, 6])  # mean 6
    router.update_bias(counts)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([-0.01, 0.01, 0, 0, 0, 0, 0, 0]))
    router.update_bias(counts)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([-0.02, 0.02, 0, 0, 0, 0, 0, 0]))


def test_bias_changes_the_choice_but_not_the_weights():
    router = _router(bias_update_rate=0.01)
    x = torch.randn(64, 16)
    before = router(x)
    favoured = 3
    with torch.no_grad():
        router.e_score_correction_bias[favoured] = 1.0  # beats any probability gap
    after = router(x)
    assert (after.topk_ids_Tk == favoured).any(-1).all()
    assert not torch.equal(before.topk_ids_Tk, after.topk_ids_Tk)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    expected = probs.gather(1, after.topk_ids_Tk)
    torch.testing.assert_close(after.topk_w_Tk, expected / expected.sum(-1, keepdim=True))
    (after.topk_w_Tk ** 2).sum().backward()
    assert router.weight.grad.abs().sum() > 0 and router.e_score_correction_bias.grad is None


def _forward_and_record(router, x):
    out = router(x)
    router.record_counts(out.counts_E)  # as the MoE block does
    return out


def test_training_forwards_count_slots_and_eval_does_not():
    router = _router(bias_update_rate=0.01)
    x = torch.randn(40, 16)
    ids = torch.cat([_forward_and_record(router, x).topk_ids_Tk, _forward_and_record(router, x[:8]).topk_ids_Tk])
    counts = router.take_counts()
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=8)) and counts.sum() == 48 * 2
    assert not router.take_counts().any()  # reset by the read
    with torch.no_grad():
        _forward_and_record(router, x)
    router.eval()
    _forward_and_record(router, x)
    assert not router.expert_counts.any()


def test_a_checkpoint_recompute_does_not_count_again():
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    router = _router(bias_update_rate=0.01)
    x = torch.randn(40, 16)
    recomputed = []

    def layer(t):
        recomputed.append(torch.is_grad_enabled())
        return _forward_and_record(router, t).topk_w_Tk
    with set_checkpoint_early_stop(False):  # the recompute runs the whole function, record_counts included
        out = checkpoint(layer, x, use_reentrant=False)
        (out * torch.randn_like(out)).sum().backward()
    assert len(recomputed) == 2 and router.weight.grad is not None
    assert router.take_counts().sum() == 40 * 2


def test_bias_balancing_evens_out_a_skewed_router():
    router = _router(bias_update_rate=0.002)
    with torch.no_grad():
        router.weight[0] += 0.5  # expert 0 dominates
    gen = torch.Generator().manual_seed(1)
    spread = []  # busiest expert / mean, per step
    for _ in range(100):
        _forward_and_record(router, torch.randn(2048, 16, generator=gen))
        counts = router.take_counts()
        spread.append(float(counts.max() / counts.float().mean()))
        router.update_bias(counts)
    assert spread[0] > 1.9 and sum(spread[-10:]) / 10 < 1.3, spread


def test_bias_is_a_persistent_fp32_buffer_and_counts_are_not():
    keys = _router(bias_update_rate=0.01).state_dict().keys()
    assert "e_score_correction_bias" in keys and "expert_counts" not in keys
    assert "e_score_correction_bias" not in _router().state_dict()

"""CPU tests of runtime/loss.py (linear + cross-entropy over label tokens).

Every implementation that runs on a CPU against an oracle written here in plain torch
(`F.cross_entropy` on logits computed in the test, never through runtime/loss.py): the loss and the grads
of h and weight, in fp64-checked fp32, with bf16 inputs and under CPU bf16 autocast; labels ignored at
random places or everywhere; a frozen weight; a weight tied into the rest of the graph. Then what the
chunked implementation keeps and computes: nothing of [T, V] saved for backward, no [T, V] op output, no
[V, H] gradient for a frozen weight. Then the registry's names and messages.

Shapes: h [T, H], weight [V, H], labels [T]; T=37, H=16, V=101 (chunk sizes chosen not to divide T).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.loss import IGNORE_INDEX, LOSS_IMPLS, chunked, default_chunk_size, linear_cross_entropy_sum

T, H, V = 37, 16, 101
CPU_IMPLS = ["plain", "chunked", "triton"]  # triton: in the Triton interpreter on the CPU


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-relative error (the repo's tolerance measure)."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def make_inputs(dtype=torch.float32, ignore_frac=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h_TH = torch.randn(T, H, generator=gen).to(dtype)
    weight_VH = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype)
    labels_T = torch.randint(0, V, (T,), generator=gen)
    labels_T[torch.rand(T, generator=gen) < ignore_frac] = IGNORE_INDEX
    return h_TH, weight_VH, labels_T


def oracle_loss(h_TH, weight_VH, labels_T):
    """The loss the trainer computed before runtime/loss.py existed, written out independently (logits
    upcast to fp32 for the loss, or kept in fp64 when that is the inputs' dtype)."""
    logits_TV = h_TH @ weight_VH.T
    logits_TV = logits_TV if logits_TV.dtype == torch.float64 else logits_TV.float()
    return F.cross_entropy(logits_TV, labels_T, ignore_index=-100, reduction="sum")


def loss_and_grads(loss_fn, h_TH, weight_VH, labels_T, weight_grad=True, scale=0.37):
    """Loss and the grads of (h, weight) for `scale * loss` (a non-unit upstream grad, as the trainer's
    division by the label count gives)."""
    h = h_TH.clone().requires_grad_()
    w = weight_VH.clone().requires_grad_(weight_grad)
    loss = loss_fn(h, w, labels_T)
    (scale * loss).backward()
    return loss.detach(), h.grad, w.grad


def impl_fn(impl, **kwargs):
    return lambda h, w, labels: LOSS_IMPLS.get(impl)(h, w, labels, **kwargs)


# -- parity ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_fn", [
    impl_fn("plain"),
    impl_fn("chunked"),
    impl_fn("chunked", chunk_size=1),
    impl_fn("chunked", chunk_size=5),
    impl_fn("chunked", chunk_size=8),
    impl_fn("chunked", chunk_size=1000),
    impl_fn("triton"),
    impl_fn("triton", chunk_size=5),
    linear_cross_entropy_sum,
], ids=["plain", "chunked-default", "chunked-1", "chunked-5", "chunked-8", "chunked-1000", "triton-default", "triton-5",
      "public-auto"])
def test_fp32_matches_oracle(loss_fn):
    inputs = make_inputs()
    loss, grad_h, grad_w = loss_and_grads(loss_fn, *inputs)
    ref_loss, ref_h, ref_w = loss_and_grads(oracle_loss, *(x.double() if x.is_floating_point() else x
                                                           for x in inputs))
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert rel_err(loss, ref_loss) <= 1e-6
    assert grad_h.dtype == grad_w.dtype == torch.float32
    assert rel_err(grad_h, ref_h) <= 1e-5
    assert rel_err(grad_w, ref_w) <= 1e-5
    # ignored tokens get exactly zero gradient
    assert grad_h[inputs[2] == IGNORE_INDEX].abs().max() == 0


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_all_labels_ignored(impl):
    h_TH, weight_VH, labels_T = make_inputs(ignore_frac=1.0)
    loss, grad_h, grad_w = loss_and_grads(impl_fn(impl), h_TH, weight_VH, labels_T)
    assert loss.item() == 0.0
    assert torch.equal(grad_h, torch.zeros_like(grad_h))
    assert torch.equal(grad_w, torch.zeros_like(grad_w))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_frozen_weight(impl):
    inputs = make_inputs()
    loss, grad_h, grad_w = loss_and_grads(impl_fn(impl), *inputs, weight_grad=False)
    ref_loss, ref_h, _ = loss_and_grads(oracle_loss, *inputs, weight_grad=False)
    assert grad_w is None
    assert rel_err(loss, ref_loss) <= 1e-6
    assert rel_err(grad_h, ref_h) <= 1e-5


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_tied_weight_accumulates(impl):
    """The weight is also the embedding that produces h: its grad is the sum over both uses."""
    _, weight_VH, labels_T = make_inputs()
    ids_T = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))
    proj_HH = torch.randn(H, H, generator=torch.Generator().manual_seed(2)) / H**0.5

    def model_loss(loss_fn, weight):
        w = weight.clone().requires_grad_()
        h_TH = torch.tanh(F.embedding(ids_T, w) @ proj_HH)
        loss = loss_fn(h_TH, w, labels_T)
        (loss / 7).backward()
        return loss.detach(), w.grad

    loss, grad_w = model_loss(impl_fn(impl), weight_VH)
    ref_loss, ref_w = model_loss(oracle_loss, weight_VH)
    h_TH = torch.tanh(F.embedding(ids_T, weight_VH) @ proj_HH)
    lm_head_only = loss_and_grads(oracle_loss, h_TH, weight_VH, labels_T, scale=1 / 7)[2]
    assert rel_err(loss, ref_loss) <= 1e-6
    assert rel_err(grad_w, ref_w) <= 1e-5
    assert rel_err(lm_head_only, ref_w) > 1e-2  # the embedding path really contributes


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_bf16_inputs(impl):
    """bf16 h and weight outside autocast: bf16 matmuls, fp32 loss, bf16 grads."""
    inputs = make_inputs(dtype=torch.bfloat16)
    loss, grad_h, grad_w = loss_and_grads(impl_fn(impl, **({"chunk_size": 6} if impl in ("chunked", "triton") else {})),
                                          *inputs)
    ref_loss, ref_h, ref_w = loss_and_grads(oracle_loss, *inputs)
    assert loss.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == torch.bfloat16
    assert rel_err(loss, ref_loss) <= 1e-3
    assert rel_err(grad_h, ref_h) <= 2e-2
    assert rel_err(grad_w, ref_w) <= 2e-2


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_autocast_matches_linear_under_autocast(impl):
    """fp32 h and master weight under bf16 autocast compute like nn.Linear does there (bf16 matmuls),
    not in fp32; grads come back in fp32."""
    inputs = make_inputs(seed=4)
    fn = impl_fn(impl, **({"chunk_size": 6} if impl in ("chunked", "triton") else {}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad_h, grad_w = loss_and_grads(fn, *inputs)
        ref_loss, ref_h, ref_w = loss_and_grads(oracle_loss, *inputs)
    fp32_loss = loss_and_grads(oracle_loss, *inputs)[0]
    assert grad_h.dtype == grad_w.dtype == torch.float32
    assert rel_err(ref_loss, fp32_loss) > 5e-5  # bf16 matmuls are visible in the loss ...
    assert rel_err(loss, ref_loss) <= 1e-6      # ... and reproduced
    assert rel_err(grad_h, ref_h) <= 1e-2
    assert rel_err(grad_w, ref_w) <= 1e-2


def test_mismatched_dtypes_outside_autocast():
    h_TH, weight_VH, labels_T = make_inputs()
    with pytest.raises(ValueError, match="dtypes differ"):
        linear_cross_entropy_sum(h_TH.bfloat16(), weight_VH, labels_T)


def test_second_backward_fails_loudly():
    """The chunked backward scales its saved grads in place; a second backward must not reuse them."""
    h_TH, weight_VH, labels_T = make_inputs()
    h = h_TH.requires_grad_()
    loss = chunked(h, weight_VH.requires_grad_(), labels_T)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_no_grad_returns_loss_only():
    h_TH, weight_VH, labels_T = make_inputs()
    with torch.no_grad(), OpShapes() as ops:
        loss = chunked(h_TH.requires_grad_(), weight_VH.requires_grad_(), labels_T)
    assert rel_err(loss, oracle_loss(h_TH.detach(), weight_VH.detach(), labels_T)) <= 1e-6
    assert not ops.computed((V, H)) and not ops.computed((T, H))  # no gradient buffers


# -- memory shape ------------------------------------------------------------------------------------

class OpShapes(TorchDispatchMode):
    """Shapes of the tensors that non-view aten ops produce while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor)]
        return out

    def computed(self, shape) -> bool:
        return tuple(shape) in self.shapes

    def max_rows_of_width(self, width: int) -> int:
        return max((s[0] for s in self.shapes if len(s) == 2 and s[1] == width), default=0)


def saved_numels(loss_fn, h_TH, weight_VH, labels_T) -> list[int]:
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(h_TH.clone().requires_grad_(), weight_VH.clone().requires_grad_(), labels_T)
    return numels


def test_chunked_saves_nothing_of_logits_size():
    inputs = make_inputs(ignore_frac=0.0)
    assert max(saved_numels(impl_fn("plain"), *inputs)) >= T * V  # the probe sees plain's logits
    assert max(saved_numels(impl_fn("chunked", chunk_size=4), *inputs)) <= V * H < T * V


def test_chunked_logits_never_exceed_a_chunk():
    inputs = make_inputs(ignore_frac=0.0)
    with OpShapes() as plain_ops:
        loss_and_grads(impl_fn("plain"), *inputs)
    with OpShapes() as chunked_ops:
        loss_and_grads(impl_fn("chunked", chunk_size=4), *inputs)
    assert plain_ops.max_rows_of_width(V) == T
    assert chunked_ops.max_rows_of_width(V) == 4


def test_chunked_visits_only_label_tokens():
    h_TH, weight_VH, labels_T = make_inputs(ignore_frac=0.0)
    labels_T[3:] = IGNORE_INDEX
    with OpShapes() as ops:
        loss_and_grads(impl_fn("chunked", chunk_size=16), h_TH, weight_VH, labels_T)
    assert ops.max_rows_of_width(V) == 3


@pytest.mark.parametrize("weight_grad", [True, False])
def test_chunked_frozen_weight_computes_no_weight_grad(weight_grad):
    h_TH, weight_VH, labels_T = make_inputs()
    h_TH.requires_grad_()
    weight_VH.requires_grad_(weight_grad)
    with OpShapes() as ops:
        chunked(h_TH, weight_VH, labels_T, chunk_size=8).backward()
    assert ops.computed((V, H)) == weight_grad
    assert (weight_VH.grad is not None) == weight_grad


def test_default_chunk_size():
    assert default_chunk_size(151936) * 151936 * 4 <= 1 << 30 < (default_chunk_size(151936) + 1) * 151936 * 4
    assert default_chunk_size(1 << 40) == 1


def test_chunked_under_torch_compile():
    """Callable from a compiled region (dynamo may break the graph around it) with the same results."""
    inputs = make_inputs()
    compiled = torch.compile(impl_fn("chunked", chunk_size=8), backend="eager")
    loss, grad_h, grad_w = loss_and_grads(compiled, *inputs)
    ref_loss, ref_h, ref_w = loss_and_grads(oracle_loss, *inputs)
    assert rel_err(loss, ref_loss) <= 1e-6
    assert rel_err(grad_h, ref_h) <= 1e-5 and rel_err(grad_w, ref_w) <= 1e-5


# -- registry ----------------------------------------------------------------------------------------

def test_registry_names_and_auto():
    assert set(LOSS_IMPLS.names()) == {"auto", "plain", "chunked", "triton", "liger", "cce"}
    assert LOSS_IMPLS.config_key == "model.loss_impl"
    from runtime.choices import Needs, choose

    assert choose("model.loss_impl", "auto", Needs("cpu"))[0] == "chunked"
    assert choose("model.loss_impl", "auto", Needs("cuda"))[0] == "triton"
    with pytest.raises(ValueError, match="model.loss_impl"):
        LOSS_IMPLS.get("fused")


@pytest.mark.parametrize(("impl", "module", "hint"), [
    ("liger", "liger_kernel", "pip install liger-kernel"),
    ("cce", "cut_cross_entropy", "pip install cut-cross-entropy"),
])
def test_unavailable_message(impl, module, hint):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    from runtime.choices import Needs, choose
    from runtime.config import ConfigError

    with pytest.raises(ConfigError, match=rf"model\.loss_impl: {impl} cannot run here: the {module} package is not "
                                          rf"installed \({hint}\)"):
        choose("model.loss_impl", impl, Needs("cuda"))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_model_forward_with_labels_is_the_loss_of_its_logits(tiny_moe_ckpt, impl):
    """QwenForCausalLM(..., labels) (what the trainer calls) against cross-entropy of its own logits, with
    the lm_head trained (full fine-tune): the loss and every parameter's grad."""
    from runtime.models.build import from_pretrained

    model = from_pretrained(tiny_moe_ckpt, loss_impl=impl)
    gen = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    labels_BS = torch.roll(ids_BS, -1, dims=1)
    labels_BS[:, -1] = IGNORE_INDEX
    labels_BS[0, :5] = IGNORE_INDEX

    def loss_and_grads(fused: bool):
        model.zero_grad()
        if fused:
            loss = model(ids_BS, labels=labels_BS)
        else:
            loss = F.cross_entropy(model(ids_BS).flatten(0, 1).float(), labels_BS.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(fused=True)
    ref_loss, ref_grads = loss_and_grads(fused=False)
    assert rel_err(loss, ref_loss) < 1e-6
    assert grads.keys() == ref_grads.keys() and "lm_head.weight" in grads
    assert max(rel_err(grads[n], ref_grads[n]) for n in grads) < 1e-5


@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_a_given_label_count_gives_the_counted_result(impl):
    """The host's label count (no device read) selects the rows nonzero would: the same loss and gradients;
    a bound above the true count (a graphed step's bucket) too, its extra rows adding nothing."""
    g = torch.Generator().manual_seed(0)
    T, H, V = 23, 8, 37
    h = torch.randn(T, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::3] = IGNORE_INDEX
    count = int((labels != IGNORE_INDEX).sum())
    fn = LOSS_IMPLS.get(impl)
    expected = loss_and_grads(lambda *a: fn(*a, chunk_size=4), h, w, labels)
    given = loss_and_grads(lambda *a: fn(*a, num_labels=count, chunk_size=4), h, w, labels)
    for a, b in zip(given, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for bound in (count + 1, count + 6, T):
        bounded = loss_and_grads(lambda *a, n=bound: fn(*a, num_labels=n, chunk_size=4), h, w, labels)
        for a, b in zip(bounded, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

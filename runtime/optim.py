"""What trainable parameters are kept in, the optimizer that updates them, and the LR schedule.

`optim.master_dtype` picks one of two contracts (apply_master_dtype, then build_optimizer):

    fp32  trainable parameters fp32 on CUDA (bf16 autocast computes, FSDP2 gathers them in bf16), fp32
          grads, torch AdamW (fused on CUDA) with fp32 states: 16 bytes per trainable parameter. Off CUDA
          there is no autocast: parameters stay in model.dtype. The reference; pick it for LoRA (few
          trainable parameters, so nothing to save) or whenever memory allows.
    bf16  trainable parameters bf16 everywhere, bf16 grads, StochasticRoundingAdamW with bf16 states that
          computes each update in fp32 and writes the parameter back with stochastic rounding: 8 bytes per
          parameter. Pick it for full fine-tunes that do not fit with fp32 masters. Stochastic rounding
          is what keeps it training: an update below half a bf16 ulp (2^-9 to 2^-8 of the weight) rounds to
          nearest as no change at all, so plain bf16 AdamW stalls once lr * update is that small,
          while rounded stochastically the weight moves by it on average.

StochasticRoundingAdamW updates the parameters of a step in one torch.compile'd call per decoder layer on
CUDA (build_optimizer chunks them by layer name). Identical layers share one compiled graph, so the compile
cost is that of one layer; a single graph over every parameter compiles for minutes on deep models, and a
compiled call per parameter, as torchao's, is host-bound (docs/benchmarks.md#end-to-end-one-gpu). Its states are
bf16 tensors shaped and placed like their parameter (DTensor shards under FSDP2 / EP), saved and resumed
by DCP like torch AdamW's; the update is elementwise, so it runs on the local shards. The rounding draws
from the device's default generator, which checkpoints save and restore.
"""

from __future__ import annotations

import itertools
import math
import re
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from runtime.config import Config, ConfigError, OptimConfig

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lr_factor(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at max_steps (`step` counts from 0)."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    progress = (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine


def apply_master_dtype(model: torch.nn.Module, master_dtype: str, device: torch.device) -> None:
    """Casts the trainable parameters in place to what `master_dtype` keeps them in (module docstring);
    frozen parameters keep model.dtype. Call after LoRA is applied and before FSDP shards the model."""
    if master_dtype == "fp32" and device.type != "cuda":
        return  # no autocast off CUDA: parameters compute in their own dtype, model.dtype's
    dtype = MASTER_DTYPES[master_dtype]
    if master_dtype == "bf16" and device.type != "cuda":
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
        if frozen - {dtype}:
            raise ConfigError(f"optim.master_dtype: bf16 on {device.type} needs model.dtype: bfloat16 when some "
                             f"parameters are frozen (they are {sorted(map(str, frozen))}): without autocast "
                             "bf16 trainable and fp32 frozen weights cannot compute together")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device):
    """(optimizer, LambdaLR scheduler) over the trainable parameters, per cfg.optim.master_dtype; the
    parameters must already be in that dtype (apply_master_dtype)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("no trainable parameters: enable lora or unfreeze the model")
    o = cfg.optim
    if o.master_dtype == "bf16":
        optimizer = _stochastic_rounding_adamw(params, o, layer_chunks(model))
    else:
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                      fused=device.type == "cuda")
        optimizer.groups_by_kind = split_by_kind(optimizer)  # read by optimizer_step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, o, cfg.train.max_steps))
    return optimizer, scheduler


def optimizer_step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor, skip: torch.Tensor) -> None:
    """optimizer.step() on every gradient times grad_scale (the clip factor), or no update at all where skip
    is 1: both device scalars, decided on the device, so the host queues the update without waiting for it.
    Our AdamW and torch's fused AdamW take both inside their update kernel (fused AdamW through torch's AMP
    protocol, the grad_scale / found_inf GradScaler sets: it divides by grad_scale and counts no step on
    found_inf); a separate multiply would read and write every gradient once more. Any other optimizer
    (the non-fused AdamW off CUDA) reads the two on the host, where that costs no wait. The gradients are
    dropped after the step, so which way they are left is moot."""
    if isinstance(optimizer, StochasticRoundingAdamW):
        optimizer.step(grad_scale=grad_scale, skip=skip)
        return
    if optimizer.defaults.get("fused"):
        optimizer.grad_scale = (1 / grad_scale).float()
        optimizer.found_inf = skip.float()
        try:
            with groups_of_one_kind(optimizer):
                optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        return
    if skip.item():
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if (scale := grad_scale.item()) != 1.0:
        torch._foreach_mul_([_local(p.grad) for p in params], scale)
    optimizer.step()


def split_by_kind(optimizer: torch.optim.Optimizer) -> list[list[list[torch.Tensor]]] | None:
    """Per group, its DTensor and its plain parameters, where some group holds both (else None). torch's fused
    AdamW updates a group in one kernel, which refuses the two together; with LoRA at ep = the world the
    trainables outside the experts are plain (runtime/distributed/replicate.py), the experts' DTensors."""
    split = [[kind for kind in ([p for p in group["params"] if isinstance(p, DTensor)],
                                [p for p in group["params"] if not isinstance(p, DTensor)]) if kind]
             for group in optimizer.param_groups]
    return split if any(len(kinds) > 1 for kinds in split) else None


@contextmanager
def groups_of_one_kind(optimizer: torch.optim.Optimizer):
    """The optimizer's groups split as build_optimizer's split_by_kind says, for the duration (the same state and
    settings): the groups themselves stay as they are, so checkpoints keep one format in every layout."""
    split = getattr(optimizer, "groups_by_kind", None)
    if split is None:
        yield
        return
    groups = optimizer.param_groups
    optimizer.param_groups = [{**group, "params": params} for group, kinds in zip(groups, split) for params in kinds]
    try:
        yield
    finally:
        optimizer.param_groups = groups


def layer_chunks(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    """Each trainable parameter's update chunk: the path up to its first numbered component ("model.layers.3",
    "mtp.0"), or "" outside any numbered module list."""
    chunks = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            numbered = re.match(r"(.*?\.\d+)(\.|$)", name)
            chunks[p] = numbered.group(1) if numbered else ""
    return chunks


def _stochastic_rounding_adamw(params: list[torch.nn.Parameter], o: OptimConfig,
                               chunk_of: dict[torch.Tensor, str]) -> torch.optim.Optimizer:
    # Only bf16 parameters are rounded stochastically; any other dtype would silently round to nearest.
    if wrong := sorted({str(p.dtype) for p in params if p.dtype != torch.bfloat16}):
        raise ConfigError(f"optim.master_dtype: bf16 needs bf16 trainable parameters, found {wrong}: "
                         "call runtime.optim.apply_master_dtype before build_optimizer")
    return StochasticRoundingAdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                   chunk_of=chunk_of)


def round_to_bf16_stochastically(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded up or down with probability proportional to the distance (unbiased): uniform
    random low 16 bits are added to the fp32 bit pattern, which is then truncated. Sign-magnitude bits
    make it symmetric for negatives; inf and nan stay what they are."""
    bits = x.float().view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low bits are zero


def _adamw_update(params, grads, exp_avgs, exp_avg_sqs, lr, step, grad_scale, keep, beta1: float, beta2: float,
                  eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's update of every parameter on its gradient times grad_scale, in fp32 from bf16
    tensors: states stored rounded to nearest, parameters stochastically; where keep is 0 every tensor keeps
    its value. lr, the step count, grad_scale and keep are 0-dim tensors, so a new value each step does not
    recompile."""
    bias_c1 = 1 - beta1**step
    bias_c2_sqrt = (1 - beta2**step).sqrt()
    kept = keep > 0
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g32, m_old, v_old = g.float() * grad_scale, m.float(), v.float()
        m32 = m_old.lerp(g32, 1 - beta1)
        v32 = v_old.lerp(g32 * g32, 1 - beta2)
        p32 = p.float() * (1 - lr * weight_decay)
        p32 = p32 - (lr / bias_c1) * m32 / (v32.sqrt() / bias_c2_sqrt + eps)
        m.copy_(torch.where(kept, m32, m_old))
        v.copy_(torch.where(kept, v32, v_old))
        p.copy_(torch.where(kept, round_to_bf16_stochastically(p32), p))


_compiled_adamw_update = torch.compile(_adamw_update, fullgraph=True, dynamic=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW for bf16 parameters with bf16 states and stochastically rounded parameter updates (module
    docstring). On CUDA a step is one compiled call per run of consecutive parameters of the same chunk
    (`chunk_of`: parameter -> chunk name; absent: one chunk); elsewhere the same code eager."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 chunk_of: dict[torch.Tensor, str] | None = None):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._chunk_of = chunk_of or {}

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | float = 1.0, skip: torch.Tensor | None = None):
        """One update of every parameter with a gradient, on its gradient times grad_scale (the multiply
        is inside the update: the gradients are read once and left as they were); none where skip is 1
        (a device scalar: parameters, states and step counts keep their values)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params, grad_scale, skip)
        return loss

    def _step_group(self, group: dict, params: list[torch.Tensor], grad_scale, skip) -> None:
        states = [self._state(p) for p in params]
        device = _local(params[0]).device
        keep = torch.ones((), device=device) if skip is None else (1 - skip).to(device, torch.float32)
        steps = [s["step"] for s in states]
        # the list overload: the scalar-tensor one reads its scalar on the host (a sync)
        torch._foreach_add_(steps, [keep] * len(steps))
        beta1, beta2 = group["betas"]
        scalars = (torch.tensor(group["lr"], dtype=torch.float32), states[0]["step"],  # a group steps together
                   torch.as_tensor(grad_scale, dtype=torch.float32, device=device), keep)
        update = _compiled_adamw_update if device.type == "cuda" else _adamw_update
        # consecutive parameters of one chunk per call, in order (the rounding draws stay in order)
        for _, run in itertools.groupby(zip(params, states), key=lambda pair: self._chunk_of.get(pair[0], "")):
            ps, ss = zip(*run)
            update([_local(p) for p in ps], [_local(p.grad) for p in ps], [_local(s["exp_avg"]) for s in ss],
                   [_local(s["exp_avg_sq"]) for s in ss], *scalars, beta1, beta2, group["eps"],
                   group["weight_decay"])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then every step count on its parameter's device (a checkpoint may hold it on the host)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if "step" in state:
                state["step"] = state["step"].to(_local(p).device)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            # on the device, as fused AdamW's: a skipped step (decided there) does not count
            state["step"] = torch.zeros((), device=_local(p).device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

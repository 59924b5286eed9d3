"""Training checkpoints with torch.distributed.checkpoint (DCP), written atomically, and the final exports.

Layout: <output_dir>/checkpoints/step_00000012/ holds the DCP shards of model + optimizer and one
`extra_rank{r}.pt` per rank (step, LR schedule, data position, RNG states) and `meta.json` (step, run
id, world size, ep). A save goes to a temporary sibling folder that is renamed only once every rank has
finished, so a crash mid-save leaves the last good checkpoint intact. Only finite parameters are
saved, and a resumed checkpoint is checked finite, so every checkpoint named "last good" is. Pruning
keeps the newest `keep_last` of this run and never touches another run's checkpoints.
With LoRA only trainable parameters are saved (the frozen base comes from model.path on resume).

Resharding: every tensor is saved under its parameter's name with its global shape; expert tensors
(weights, expert LoRA factors, their optimizer states) as [E, ...] in global expert order
(runtime.distributed.state_dict.global_expert_view), so DCP reshards on load and a run resumes under
another ep, FSDP size and world size. The extra state is the same on every rank except the RNG
states: with the world size unchanged each rank reads its own file, otherwise rank r reads the file
of rank r % (saved world size). The data position is a row of one global stream (runtime.data), so
it carries over; the global batch is micro_batch_size * dp_world * grad_accum_steps of the new run.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from runtime.distributed.process_group import DistEnv, all_reduce_sum
from runtime.distributed.state_dict import global_expert_view, is_expert_param
from runtime.run_dir import STEP_DIR, RunDir, finished_checkpoints

log = logging.getLogger("runtime")


class ResumeError(ValueError):
    """A checkpoint that does not belong to this run's model; the message lists the mismatches."""


class NonFiniteParameters(RuntimeError):
    """The parameters hold NaN or inf at a save; nothing was written."""


def count_nonfinite(model: torch.nn.Module, env: DistEnv) -> int:
    """Non-finite parameter entries over all ranks (a collective when the run is distributed)."""
    local = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p  # FSDP / EP DTensors: this rank's shard
        local += int((~torch.isfinite(t.detach())).sum())
    return int(all_reduce_sum(local, env))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state_dict_options(model: torch.nn.Module, strict: bool = True) -> StateDictOptions:
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=strict)


def _checkpoint_state(model, optimizer) -> tuple[dict, dict, dict]:
    """(what DCP saves and loads, model_sd, optim_sd for set_state_dict). Expert entries of the first are
    global views sharing storage with the others, so a DCP load into the first fills them."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_dict_options(model))
    model_view = {k: global_expert_view(v) if is_expert_param(model, k) else v for k, v in model_sd.items()}
    state_view = {k: {n: global_expert_view(t) for n, t in s.items()} if is_expert_param(model, k) else s
                  for k, s in optim_sd.get("state", {}).items()}
    return {"model": model_view, "optim": {**optim_sd, "state": state_view}}, model_sd, optim_sd


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json; {} for checkpoints written before it existed."""
    meta = path / "meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


class CheckpointManager:
    def __init__(self, run_dir: RunDir, keep_last: int, env: DistEnv, ep: int = 1):
        self.root = run_dir.checkpoints
        self.run_id = run_dir.run_id
        self.keep_last = keep_last
        self.env = env
        self.rank = env.rank
        self.ep = ep

    def step_dirs(self) -> list[Path]:
        return finished_checkpoints(self.root.parent)

    def latest(self) -> Path | None:
        dirs = self.step_dirs()
        return dirs[-1] if dirs else None

    def save(self, step: int, model, optimizer, scheduler, loader) -> Path:
        if bad := count_nonfinite(model, self.env):
            raise NonFiniteParameters(f"{bad} parameter values are NaN or inf at step {step}; "
                                      "the checkpoint was not written")
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-step_{step:08d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(_checkpoint_state(model, optimizer)[0], checkpoint_id=str(tmp))
        extra = {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                 "rng": _rng_state()}
        torch.save(extra, tmp / f"extra_rank{self.rank}.pt")
        _barrier()
        if self.rank == 0:
            meta = {"step": step, "run_id": self.run_id, "world_size": self.env.world_size, "ep": self.ep}
            (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._prune(step)
        _barrier()
        return final

    def _prune(self, step: int) -> None:
        """Removes this run's checkpoints older than the newest keep_last; other runs' are left alone."""
        ours = [p for p in self.step_dirs()
                if read_meta(p).get("run_id") == self.run_id and int(STEP_DIR.match(p.name)[1]) <= step]
        for old in ours[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def extra_file(self, path: Path) -> Path:
        """This rank's extra state: its own file, or under another world size rank % saved world's (the
        files differ only in their RNG states). Read from the checkpoint's files only, so every rank
        decides alike before any collective."""
        meta = read_meta(path)
        saved_world = meta.get("world_size", len(list(path.glob("extra_rank*.pt"))))
        saved_ep = meta.get("ep", 1)
        if (saved_world, saved_ep) != (self.env.world_size, self.ep) and self.rank == 0:
            log.info("resharding %s: written by %d ranks with ep=%d, resumed on %d ranks with ep=%d", path,
                     saved_world, saved_ep, self.env.world_size, self.ep)
        return path / f"extra_rank{self.rank % max(saved_world, 1)}.pt"

    def check_compatible(self, path: Path, model_state: dict) -> None:
        """Compares the checkpoint's keys and shapes with `model_state` (what DCP would load), from
        metadata only, so a wrong checkpoint fails on every rank alike before any collective."""
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        saved = {k.removeprefix("model."): tuple(v.size) for k, v in meta.items()
                 if k.startswith("model.") and hasattr(v, "size")}
        ours = {k: tuple(v.shape) for k, v in model_state.items()}
        missing = sorted(set(ours) - set(saved))
        unexpected = sorted(set(saved) - set(ours))
        mismatched = sorted(f"{k}: checkpoint {saved[k]} vs model {ours[k]}" for k in set(ours) & set(saved)
                            if saved[k] != ours[k])
        if missing or unexpected or mismatched:
            lines = [(f"checkpoint {path} was written for a different model (check model.path, model.config, "
                      "lora and train.output_dir, or start without --resume):")]
            for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
                if items:
                    lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:10]))
            raise ResumeError("\n".join(lines))

    def load(self, path: Path, model, optimizer, scheduler, loader) -> int:
        """Restores everything `save` wrote; returns the step to continue after."""
        extra_file = self.extra_file(path)
        state, model_sd, optim_sd = _checkpoint_state(model, optimizer)
        self.check_compatible(path, state["model"])
        dcp.load(state, checkpoint_id=str(path))
        # Tensors were loaded in place (the expert views share the storage of model_sd's and optim_sd's);
        # the param groups' values were replaced in `state`.
        optim_sd = {**optim_sd, "param_groups": state["optim"]["param_groups"]}
        # Not strict: a frozen base is not in the checkpoint (check_compatible has matched the keys).
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=_state_dict_options(model, strict=False))
        extra = torch.load(extra_file, weights_only=False)
        scheduler.load_state_dict(extra["scheduler"])
        loader.load_state_dict(extra["loader"])
        _set_rng_state(extra["rng"])
        if bad := count_nonfinite(model, self.env):
            raise ResumeError(f"checkpoint {path} holds {bad} NaN or inf parameter values; move it out of "
                              f"{self.root} to resume from the one before it")
        return extra["step"]


def export_final(model, cfg, rank: int, meshes=None) -> Path:
    """The trained result in HF form, gathered from the shards: a PEFT adapter (LoRA runs) under
    <output_dir>/adapter, else a full HF checkpoint under <output_dir>/hf. Every rank calls it. Router
    selection biases (model.router_bias_update_rate) go beside either as router_bias.safetensors."""
    from functools import partial

    from runtime.distributed.state_dict import full_state_dict, gather_full
    from runtime.lora import export_peft
    from runtime.models.hf import pop_router_bias, save_pretrained, write_router_bias

    out = Path(cfg.train.output_dir)
    if cfg.lora.enabled:
        out = out / "adapter"
        export_peft(model, out, cfg.model.path, gather=partial(gather_full, meshes=meshes))
        if rank == 0:  # the biases are buffers, the same whole tensor on every rank
            write_router_bias(pop_router_bias({k: b.detach().cpu() for k, b in model.named_buffers()}), out, out)
    else:
        out = out / "hf"
        state = full_state_dict(model, meshes, keep=rank == 0)
        if rank == 0:
            save_pretrained(model, out, state=state)
    _barrier()
    return out

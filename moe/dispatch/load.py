"""The EP load log: how evenly a dispatcher's exchanges spread the routed slots over the EP ranks.

    log.add(valid_slots)                       # in each training dispatch: slots this rank computes
    imbalance = log.read(group, device)        # collective over the EP group; resets the log

Every exchange waits for the EP rank with the most slots to compute, which a single process never does, so
this is the expert-parallel share of a step's time that routing decides: read(...) is the mean over the
logged dispatches of (the busiest rank's slots / the group's mean), 1.0 when every rank computes as many.
Dispatches without autograd (eval) are not logged; a checkpointed layer's recompute logs its dispatch again,
with the same counts. Every rank of the group logs the same number of dispatches (each is a collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LoadLog:
    def __init__(self):
        self._slots: list[int] = []

    def add(self, valid_slots: int) -> None:
        if torch.is_grad_enabled():
            self._slots.append(valid_slots)

    def read(self, group: dist.ProcessGroup, device: torch.device) -> float | None:
        """Mean over the logged dispatches of max / mean slots over the group's ranks (None: none logged)."""
        slots, self._slots = self._slots, []
        if not slots:  # the same on every rank: none skips a collective the others make
            return None
        mine_D = torch.tensor(slots, dtype=torch.float64, device=device)
        ranks = torch.empty(dist.get_world_size(group) * len(slots), dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(ranks, mine_D, group=group)  # flat: gloo takes no [R, D] output
        ranks_RD = ranks.view(-1, len(slots))
        mean_D = ranks_RD.mean(0)
        busy = mean_D > 0  # a dispatch that routed nothing anywhere is balanced
        ratio_D = torch.where(busy, ranks_RD.max(0).values / mean_D.clamp_min(1e-30), 1.0)
        return float(ratio_D.mean())

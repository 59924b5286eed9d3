"""The EP load log: how evenly a dispatcher's exchanges spread the routed slots over the EP ranks, and how far
apart the ranks' hosts reach them.

    log.add(valid_slots, wait_s)               # in each training dispatch
    reading = log.read(group, device)          # collective over the EP group; resets the log

Every exchange waits for the EP rank with the most slots to compute, which a single process never does, so
`reading.imbalance` is the expert-parallel share of a step's time that routing decides: the mean over the
logged dispatches of (the busiest rank's slots / the group's mean), 1.0 when every rank computes as many.

`wait_s` is how long the host spent in the dispatch's count exchange (the collective and the host sync of its
split sizes). That exchange completes for every rank at about the same moment (when the last rank's device
reaches it), so the ranks' waits differ by when their hosts arrived: `reading.host_skew_s` sums over the
dispatches the longest wait minus the shortest (how long the hosts ahead waited for the one behind), and
`reading.slowest_host` is the EP rank that waited least in all (the host the others wait for). Routing
imbalance delays every rank's completion alike, so it does not show in the skew: the two are separate. Only
the forward dispatches have a count exchange, so the skew is the forward pass's.

Dispatches without autograd (eval) are not logged; a checkpointed layer's recompute logs its dispatch again,
with the same counts. Every rank of the group logs the same number of dispatches (each is a collective).

`DeviceLoadLog` is the log of a dispatcher whose every rank sees every rank's routing (all_gather): it keeps
the imbalance on the device (no host sync, and it traces under torch.compile), and its host fields are None:
no host waits in that exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LoadReading:
    imbalance: float     # mean over dispatches of the busiest rank's slots / the mean
    host_skew_s: float | None   # sum over dispatches of the longest minus the shortest host wait (None: no waits)
    slowest_host: int | None    # EP rank (in the group) with the least host wait in all


class LoadLog:
    def __init__(self):
        self._slots: list[int] = []
        self._waits: list[float] = []

    def add(self, valid_slots: int, wait_s: float) -> None:
        if torch.is_grad_enabled():
            self._slots.append(valid_slots)
            self._waits.append(wait_s)

    def read(self, group: dist.ProcessGroup, device: torch.device) -> LoadReading | None:
        """The reading over the dispatches logged since the last read (None: none logged)."""
        slots, waits, self._slots, self._waits = self._slots, self._waits, [], []
        if not slots:  # the same on every rank: none skips a collective the others make
            return None
        D = len(slots)
        mine_2D = torch.tensor([slots, waits], dtype=torch.float64, device=device)
        ranks = torch.empty(dist.get_world_size(group) * 2 * D, dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(ranks, mine_2D.flatten(), group=group)  # flat: gloo takes no [R, ...] output
        slots_RD, waits_RD = ranks.view(-1, 2, D).unbind(1)
        mean_D = slots_RD.mean(0)
        busy = mean_D > 0  # a dispatch that routed nothing anywhere is balanced
        ratio_D = torch.where(busy, slots_RD.max(0).values / mean_D.clamp_min(1e-30), 1.0)
        skew_D = waits_RD.max(0).values - waits_RD.min(0).values
        return LoadReading(float(ratio_D.mean()), float(skew_D.sum()), int(waits_RD.sum(1).argmin()))


class DeviceLoadLog:
    def __init__(self, ep: int, device: torch.device):
        self.ep = ep
        # [imbalance summed over dispatches, dispatches]; made now: made in a compiled forward it would be
        # one more graph
        self._sums = torch.zeros(2, device=device, dtype=torch.float64)

    def add(self, global_ids_Mk: torch.Tensor, num_local_experts: int) -> None:
        """Logs one training dispatch from every rank's expert ids (global; -1: no slot)."""
        if not torch.is_grad_enabled():
            return
        valid_Mk = global_ids_Mk >= 0
        owner_S = (global_ids_Mk.clamp_min(0) // num_local_experts).flatten()
        slots_R = torch.zeros(self.ep, device=global_ids_Mk.device, dtype=torch.float64).scatter_add_(
            0, owner_S, valid_Mk.flatten().to(torch.float64))
        mean = slots_R.mean()
        ratio = torch.where(mean > 0, slots_R.max() / mean.clamp_min(1e-30), 1.0)
        self._sums.add_(torch.stack([ratio, torch.ones_like(ratio)]))

    def take(self) -> torch.Tensor:
        """[imbalance summed over dispatches, dispatches] since the last take, on the device (no host read);
        every rank holds the same."""
        sums = self._sums.clone()
        self._sums.zero_()  # in place: a compiled dispatch keeps adding to the same tensor
        return sums

    def read(self, group: dist.ProcessGroup, device: torch.device) -> LoadReading | None:
        """The reading since the last read (None: none logged); no collective, every rank holds the same."""
        total, dispatches = self.take().tolist()
        return None if dispatches == 0 else LoadReading(total / dispatches, None, None)

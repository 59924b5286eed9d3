"""`local` dispatcher (ep=1): every expert is on this rank, so dispatch and combine are identities.

Rows are the tokens themselves (M = T) and expert ids stay global, which equal local ids here.
"""

from __future__ import annotations

import torch

from moe.dispatch.base import Dispatcher, Routed, check_routing_shapes


class LocalDispatcher(Dispatcher):
    traceable = True  # identities: nothing to sync on

    def dispatch(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor) -> Routed:
        check_routing_shapes(x_TH, topk_ids_Tk, topk_w_Tk)
        return Routed(x_TH, topk_ids_Tk, topk_w_Tk)

    def combine(self, y_MH: torch.Tensor, routed: Routed) -> torch.Tensor:
        if y_MH.shape != routed.x_MH.shape:
            raise ValueError(f"combine: y {tuple(y_MH.shape)} does not match the dispatched rows "
                             f"{tuple(routed.x_MH.shape)}")
        return y_MH

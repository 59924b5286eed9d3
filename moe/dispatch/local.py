"""`local` dispatcher (ep=1): every expert is on this rank, so dispatch and combine are identities.

Rows are the tokens themselves (M = T) and expert ids stay global, which equal local ids here.
"""

from __future__ import annotations

import torch

from moe.dispatch.base import Dispatcher, Routed, check_combine_shape, check_routing_shapes


class LocalDispatcher(Dispatcher):
    traceable = True  # identities: nothing to sync on

    def dispatch(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor) -> Routed:
        check_routing_shapes(x_TH, topk_ids_Tk, topk_w_Tk)
        return Routed(x_TH, topk_ids_Tk, topk_w_Tk)

    def combine(self, y_MH: torch.Tensor, routed: Routed) -> torch.Tensor:
        check_combine_shape(y_MH, routed)
        return y_MH

"""Local training ("Solo" in FedPCL, Tan et al., NeurIPS 2022, §5.1; "Local" in FedPFT): no federation.

Differs from FedAvg only in that nothing is shared: each client trains its own head on its own data, uploads
nothing (communication 0) and is evaluated with that head. Global model: none (there is no server).
"""

from __future__ import annotations

from .registry import register
from .base import FedAvg


@register
class Local(FedAvg):
    name = "local"
    paper = "Solo baseline of Tan et al., FedPCL, NeurIPS 2022, §5.1: every client trains alone"
    uploads = "nothing"
    personal_predict = True
    clients_hold_global = False  # nothing is shared: no server model

    def shared(self, name):
        return False

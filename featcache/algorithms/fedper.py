"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019).

Differs from FedAvg only in what is shared: the base layers (here the projection network, with its BN when bn=True)
are averaged with FedAvg's n_k / n weights; the personalisation layers (here the classifier) stay on the client.
Base and personalisation layers are trained together in every local epoch; each client is evaluated with its own
classifier on the shared projection.
Global model: none. The server holds only the base layers; every classifier is personal.
"""

from __future__ import annotations

from .registry import register
from .base import FedAvg


@register
class FedPer(FedAvg):
    name = "fedper"
    paper = "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv:1912.00818, 2019"
    uploads = "projection parameters (the body)"
    clients_hold_global = False  # the classifier stays on the client: no complete server model

    def shared(self, name):
        return name.startswith("proj")

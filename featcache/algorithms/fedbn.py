"""FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR 2021,
Alg. 1).

Differs from FedAvg only in what is shared: the head has BatchNorm (bn=True) and its affine parameters and running
statistics never leave the client (Alg. 1 averages only the layers that are not BatchNorm); every other parameter
is averaged.
FedBN's Alg. 1 averages with equal weights 1/K; the clients in its experiments are equally sized, where that equals
FedAvg's n_k / n weighting, which is kept here.
Global model: none. The server never holds the BatchNorm layers; the paper evaluates each client's local model.
"""

from __future__ import annotations

from .registry import register
from .base import FedAvg


@register
class FedBN(FedAvg):
    name = "fedbn"
    paper = "Li et al., FedBN, ICLR 2021, Alg. 1"
    uploads = "head parameters except BatchNorm (projection and classifier weights and biases)"
    clients_hold_global = False  # BatchNorm stays on the client: no complete server model
    settings = {"bn": True}

    def shared(self, name):
        return ".bn." not in name

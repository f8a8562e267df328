"""LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global Representations",
arXiv:2001.01523, 2020, Alg. 1).

Client m holds a local representation ℓ_m(·; θ^ℓ_m) under a global model g(·; θ^g). Each local step trains both on
the task loss of the client's minibatch, L = CE(g(ℓ_m(x; θ^ℓ_m); θ^g), y) (the supervised case: no auxiliary
representation loss); the server averages only the global part, θ^g ← Σ_{m∈S} n_m / n_S · θ^g_m over the round's
participants S, and every client takes it; θ^ℓ_m never leaves the client. It is FedPer's split turned upside down:
here the projection network (with its BN when bn=True) is the local representation and the classifier the global
model. Every client predicts with its own representation under the global classifier.
Choices the paper leaves open: the local representations start from the same initial model as the global one (the
paper's code starts them from a pretrained FedAvg model, PFLlib from one shared initial model, as here); the global
part is the classifier alone (the last layer, PFLlib's `model.head`; FL-bench's `lgfedavg` instead shares the first
`num_global_layers` layers and keeps the rest local, which is FedPer's split).
Against PFLlib (TsingZ0/PFLlib @ d832e76f, `serverlg.py`, `clientlg.py`): the same rounds, given its SGD (lr, no
momentum, no weight decay) as run settings; its per-round evaluation before training scores the models featcache
scores after the previous round's download.
Global model: none. The server holds only the classifier; every representation is local (the paper's new-device
test, an ensemble over the local representations, is not run).
"""

from __future__ import annotations

from .registry import register
from .base import FedAvg


@register
class LGFedAvg(FedAvg):
    name = "lg-fedavg"
    paper = (
        "Liang et al., Think Locally, Act Globally: Federated Learning with Local and Global Representations, "
        "arXiv:2001.01523, 2020, Alg. 1"
    )
    uploads = "classifier parameters (the global model; the representation stays local)"
    clients_hold_global = False  # the representation stays on the client: no complete server model

    def shared(self, name):
        return name.startswith("cls")

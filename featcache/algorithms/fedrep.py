"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated Learning", ICML 2021,
Alg. 1).

Like FedPer, the body (projection network) is shared and the head (classifier) stays local; FedRep differs in how a
client trains: first `head_epochs` epochs on the head with the body frozen, then `local_epochs` epochs on the body
with the head frozen (Alg. 1, client update). The paper's experiments use 10 head epochs and 1 body epoch (§5), the
defaults here (the engine's local_epochs = 1). The server averages the bodies; FedRep's Alg. 1 averages uniformly,
which equals FedAvg's n_k / n weighting (kept here) on equally sized clients.
Global model: none. The server holds only the body; every head is personal.
"""

from __future__ import annotations

from ..training.config import Setting
from .registry import register
from .base import FedAvg


@register
class FedRep(FedAvg):
    name = "fedrep"
    paper = "Collins et al., Exploiting Shared Representations for Personalized FL, ICML 2021, Alg. 1"
    uploads = "projection parameters (the body)"
    clients_hold_global = False  # the head stays on the client: no complete server model
    settings = {"head_epochs": Setting(10, "local epochs on the head before the body's (§5: 10)", lo=0)}

    def local_epochs(self):
        return self.cfg["head_epochs"] + self.cfg["local_epochs"]

    def shared(self, name):
        return name.startswith("proj")  # the body, as FedPer; the classifier is the client's head

    def trainable(self, name, rnd):
        head_phase = rnd.epoch < self.cfg["head_epochs"]
        return not self.shared(name) if head_phase else self.shared(name)

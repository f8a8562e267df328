"""FedGH (Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header", ACM MM 2023).

Each client's model is a feature extractor R_k(·; φ_k) (here the projection network, with its BN when bn=True) under
a prediction header H(·; θ) (here the classifier). Differences from FedAvg:
- the extractor never leaves the client; every client holds the one global header θ^{t−1}, which replaces its local
  header before training;
- local training updates extractor and header together on the task loss (FedAvg's local loss):
  (φ_k, θ_k) ← (φ_k, θ_k) − η ∇ CE(H(R_k(x; φ_k); θ_k), y);
- after training the client uploads its local averaged representation (LAR) of each class s it holds,
  R̄_k^s = 1/|D_k^s| Σ_{(x,y)∈D_k^s} R_k(x; φ_k) (eval mode), instead of any parameter;
- the server trains the header it kept on the round's LARs, each a sample labelled with its class:
  θ ← θ − η_θ ∇ CE(H(R̄_k^s; θ), s), and every client takes the result θ^t;
- each client predicts with its own extractor under the global header (`predict` after the download).
Released code followed: TsingZ0/HtFLlib @ e959261d servergh.py, clientgh.py; TsingZ0/PFLlib @ d832e76f has the same
two files but for its server header (below). Choices the paper leaves open, as the releases make them:
- the server's pass is minibatch SGD over the round's LARs, `batch_size` (the clients' batch size) per step, the last
  batch short;
- `server_epochs` passes (PFLlib: 1; HtFLlib's setting), plain SGD at `server_lr` = 0.01 (HtFLlib's default;
  PFLlib's generic default is 1.0);
- each pass takes the LARs in a random order: a permutation hashed from (seed, round, pass) (`server_order`);
- the global header starts as the clients' initial header (HtFLlib: client 0's).
Deviations from the releases:
- LARs are class means over all of a client's training rows (the paper's definition; both releases average over one
  pass of their drop_last training loader, which leaves the last n mod B rows out);
- the server's header is its own, as in HtFLlib and the paper (PFLlib's `self.head = self.clients[0].model.head` is
  client 0's header module, so client 0's local training moves the global header whenever it takes part).
The authors' script (LipingYi/FedGH, FedGH.py) is not followed: its server loop steps the clients' optimizer, so its
global header never changes.
Global model: none. The server holds only the header; every extractor is local.
"""

from __future__ import annotations


import torch

from ..training.config import Setting
from .base import FedAvg, logsumexp, one_hot
from .heads import Params
from .protos import masked_rows_mean, refresh_prototypes, server_sgd
from .registry import register

HEADER = ("cls0.weight", "cls0.bias")  # θ, the global header


def header_loss(params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CE(H(R̄; θ), s) per model, the mean over a batch of LARs x [H, b, d] with labels y [H, b]: [H]."""
    logits = torch.einsum("hbd,hkd->hbk", x, params["cls0.weight"]) + params["cls0.bias"][:, None]  # [H, b, K]
    picked = (logits * one_hot(y, logits.shape[-1])).sum(-1)  # [H, b]
    return masked_rows_mean(logsumexp(logits) - picked, mask)


@register
class FedGH(FedAvg):
    name = "fedgh"
    paper = "Yi et al., FedGH: Heterogeneous Federated Learning with Generalized Global Header, ACM MM 2023"
    uploads = "local averaged representations [K, proj_dim] + class counts [K] (no parameters)"
    fedavg_server = False  # the server trains the header on the uploaded representations
    clients_hold_global = False  # the extractor stays on the client: no complete server model
    settings = {
        "server_lr": Setting(0.01, "η_θ, the server's SGD step size on the global header (HtFLlib's default)", lo=0),
        "server_epochs": Setting(1, "passes of the server over the round's LARs (PFLlib: 1)", lo=1),
    }

    def shared(self, name):
        return name.startswith("cls")  # the header: every client holds the server's after the download

    def init_state(self, state, rnd):
        state.server = {k: state.params[k][:, 0].clone() for k in HEADER}  # θ^0: the initial header [H, ...]

    def after_local(self, state, rnd):
        refresh_prototypes(self, state, rnd)  # the participants' LARs [H, C, K, d] and class counts [H, C, K]

    def upload(self, state, rnd):
        return {"protos": state.client["protos"], "counts": state.client["counts"]}

    def aggregate(self, uploads, weights, state, rnd):
        valid = rnd.part[..., None] & (uploads["counts"] > 0)  # [H, C, K] the round's LARs
        return server_sgd(
            state.server,
            header_loss,
            uploads["protos"],
            valid,
            rnd,
            rnd.hp["server_lr"],
            self.cfg["server_epochs"],
            self.cfg["batch_size"],
        )

    def download(self, state, server, rnd):
        state.server = server
        for k, v in server.items():  # every client's header becomes θ^t; its extractor stays
            state.params[k] = rnd.expand(v)

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

from collections.abc import Callable

import torch

from ..training.config import Setting
from ..training.schedule import hash_keys
from .base import FedAvg, bcast, logsumexp, one_hot
from .heads import Params
from .protos import refresh_prototypes
from .registry import register

SERVER_PASS = 1 << 22  # hash_keys' epoch id of the server's first pass over the uploads (pass e: SERVER_PASS + e)

HEADER = ("cls0.weight", "cls0.bias")  # θ, the global header


def server_order(seeds: torch.Tensor, rnd: int, epoch: int, valid: torch.Tensor) -> torch.Tensor:
    """The uploads in the order of the server's pass `epoch` of round `rnd` (the releases' DataLoader(shuffle=True)
    over their list of uploads): valid [H, M] bool (item m = c·K + k, client c's prototype of class k) -> [H, M]
    int64, a random permutation of each model's valid items first, the others after them. `seeds` [H] on the
    device of `valid`."""
    keys = hash_keys(seeds, rnd, SERVER_PASS + epoch, shape=(valid.shape[1],)) >> 1  # [H, M]
    keys = torch.where(valid, keys, torch.iinfo(torch.int64).max)
    return torch.argsort(keys, dim=-1, stable=True)


def server_sgd(
    params: Params,
    loss: Callable[[Params, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    protos: torch.Tensor,
    valid: torch.Tensor,
    rnd,
    lr: torch.Tensor,
    epochs: int,
    batch_size: int,
) -> Params:
    """`epochs` passes of minibatch SGD on the server over the uploaded prototypes protos [H, C, K, d] where valid
    [H, C, K] (the participants' classes), each prototype a sample labelled with its class: every pass in
    `server_order`, `batch_size` prototypes per step (the last one short); the step of each model is
    p ← p − lr_h ∇ loss(p, batch [H, b, d], labels [H, b], mask [H, b])_h (loss -> [H], the mean over the batch's
    masked rows), a model whose rows ran out stays. Returns the trained params name -> [H, ...]; one host read."""
    H, C, K, d = protos.shape
    flat, ok = protos.reshape(H, C * K, d), valid.reshape(H, C * K)  # [H, M, d], [H, M]
    labels = torch.arange(C * K, device=protos.device) % K  # [M]
    n = ok.sum(1)  # [H] uploads per model
    steps = -(-int(n.max()) // batch_size)  # the round's one host read
    seeds = rnd.seeds.to(protos.device)
    params = {k: v.detach().clone() for k, v in params.items()}
    with torch.enable_grad():
        for epoch in range(epochs):
            order = server_order(seeds, rnd.round, epoch, ok)  # [H, M]
            for s in range(0, steps * batch_size, batch_size):
                idx = order[:, s : s + batch_size]  # [H, b]
                mask = s + torch.arange(idx.shape[1], device=idx.device) < n[:, None]  # [H, b]
                x = flat.gather(1, idx[..., None].expand(-1, -1, d))  # [H, b, d]
                leaves = {k: v.requires_grad_(True) for k, v in params.items()}
                grads = torch.autograd.grad(loss(leaves, x, labels[idx], mask).sum(), list(leaves.values()))
                params = {k: (v - bcast(lr, v) * g).detach() for (k, v), g in zip(leaves.items(), grads)}
    return params


def masked_rows_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each model's mean of v [H, b] over its rows where mask [H, b]: [H] (0 where it has none)."""
    m = mask.to(v.dtype)
    return (v * m).sum(1) / m.sum(1).clamp(min=1)


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

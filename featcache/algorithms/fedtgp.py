"""FedTGP (Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive Learning for
Data and Model Heterogeneity in Federated Learning", AAAI 2024). Official code: TsingZ0/FedTGP @ c77cbbb3
system/flcore/clients/clienttgp.py, servers/servertgp.py (the same two files as TsingZ0/HtFLlib @ e959261d's).

Each client's model is a feature extractor f_i (here the projection network, with its BN when bn=True) and a
classifier h_i; no parameter is ever shared. Differences from FedAvg:
- local loss: CE(h_i(f_i(x)), y) + λ·φ(f_i(x), Ĝ^y), φ the squared L2 distance averaged over the dimensions (the
  code's nn.MSELoss, following FedProto's, so that its λ = 10 keeps its scale); λ·φ is 0 until the server has sent
  prototypes (round 1 trains on CE alone), after which every class has one;
- after training the client uploads its prototypes P_i^c = mean of f_i(x) over its class-c rows (eval mode);
- the server's trainable global prototypes (TGP): Ĝ^c = W(G^c), G^c ∈ R^d a trainable embedding per class and
  W = FC(d, d) + ReLU + FC(d, d) (the code's hidden width = d); G^c ~ N(0, 1) (nn.Embedding), W as nn.Linear;
- adaptive margin: Q^c = the mean of the round's P_i^c over the participants holding c, and
  δ(t) = min(max_c min_{c'≠c} ||Q^c − Q^{c'}||, τ) over the classes the round's participants hold (10⁹ when they
  hold one class: then δ = τ);
- the server trains (G, W) with the adaptive-margin-enhanced contrastive loss on the round's P_i^c as samples,
  L^P = −log e^{−(ψ(P_i^c, Ĝ^c) + δ)} / (e^{−(ψ(P_i^c, Ĝ^c) + δ)} + Σ_{c'≠c} e^{−ψ(P_i^c, Ĝ^{c'})}), ψ the L2
  distance, i.e. CE(−(ψ(P, Ĝ) + δ·onehot(c)), c), averaged over a minibatch;
- every client then takes Ĝ^c for every class c (a class no client has sent yet too: the TGP generates it) and
  predicts the nearest one: argmin_c φ(f_i(x), Ĝ^c).
Choices the paper leaves open, as the code makes them:
- the server's training is minibatch SGD over the round's prototypes, `batch_size` (the clients' batch size) per
  step, the last batch short, for `server_epochs` passes (run_me.sh: -se 100);
- plain SGD at `server_lr` (the code's server rate is the clients' -lr, 0.01 in run_me.sh); the TGP persists across
  rounds; it is drawn from a generator seeded by the run's seed, apart from the model's;
- each pass takes the prototypes in a random order: a permutation hashed from (seed, round, pass)
  (`protos.server_order`);
- λ = 10 and τ = 100 (run_me.sh: -lam 10 -mart 100);
- ψ is computed as the code computes it, √(||P||² − 2 P·Ĝ + ||Ĝ||²), its radicand clamped at 10⁻¹² (where the code's
  rounding would give a NaN).
Deviation from the release: prototypes are class means over all of a client's training rows (the paper's
definition; the code averages over one pass of its unshuffled drop_last training loader, which leaves the last
n mod B rows out).
Global model: none. The server holds only the TGP; every client keeps its own extractor and classifier.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, bcast, logsumexp, masked_ce, masked_mean, one_hot
from .heads import Params, linear_init
from .protos import masked_rows_mean, mean_prototypes, refresh_prototypes, server_sgd, sq_distances
from .registry import register

TGP = ("tgp.emb", "tgp.mid.weight", "tgp.mid.bias", "tgp.fc.weight", "tgp.fc.bias")  # G, then W's two layers
NO_GAP = 1e9  # the code's gap of a class with no other class to measure against


def proto_mse(z: torch.Tensor, y: torch.Tensor, glob: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """Per row φ(z, Ĝ^y) = 1/d·||z − Ĝ^y||², or 0 where class y has no global prototype (or y is padding): [N]
    (FedProto's `proto_distance`, in z's dtype)."""
    onehot = one_hot(y, glob.shape[0]).to(z.dtype)  # [N, K]
    return ((z - onehot @ glob) ** 2).mean(-1) * (onehot @ has.to(z.dtype))


def tgp_init(K: int, d: int, gen: torch.Generator) -> Params:
    """One TGP, as Trainable_Global_Prototypes(K, d, d) initialises it: G [K, d] ~ N(0, 1), W's layers as nn.Linear."""
    params = {"tgp.emb": torch.randn(K, d, generator=gen)}  # [K, d]
    linear_init(params, "tgp.mid", d, d, gen)  # [d, d], [d]
    linear_init(params, "tgp.fc", d, d, gen)  # [d, d], [d]
    return params


def tgp_prototypes(params: Params) -> torch.Tensor:
    """Ĝ = W(G) for every class of every model: [H, K, d] from params name -> [H, ...]."""
    mid = torch.relu(params["tgp.emb"] @ params["tgp.mid.weight"].mT + params["tgp.mid.bias"][:, None])  # [H, K, d]
    return mid @ params["tgp.fc.weight"].mT + params["tgp.fc.bias"][:, None]  # [H, K, d]


def adaptive_margin(protos: torch.Tensor, counts: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """δ(t) = min(max_c min_{c'≠c} ||Q^c − Q^{c'}||, τ) over the classes present in counts [H, C, K] (the round's
    participants only), Q^c the unweighted mean over the clients holding c of protos [H, C, K, d]: [H]."""
    Q = mean_prototypes(protos, counts)  # [H, K, d]
    present = (counts > 0).any(1)  # [H, K]
    dist = torch.linalg.vector_norm(Q[:, :, None] - Q[:, None], dim=-1)  # [H, K, K]
    pair = present[:, :, None] & present[:, None] & ~torch.eye(Q.shape[1], dtype=torch.bool, device=Q.device)
    gap = dist.masked_fill(~pair, NO_GAP).amin(-1)  # [H, K]  each class's nearest other class
    return torch.minimum(gap.masked_fill(~present, 0).amax(-1), tau)  # [H]


def acl_loss(params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, margin: torch.Tensor):
    """L^P per model, the mean over a batch of prototypes x [H, b, d] with labels y [H, b]: [H]."""
    G = tgp_prototypes(params)  # [H, K, d]
    sq = (x * x).sum(-1, keepdim=True) - 2 * x @ G.mT + (G * G).sum(-1)[:, None]  # [H, b, K]
    dist = sq.clamp(min=1e-12).sqrt() + bcast(margin, sq) * one_hot(y, G.shape[1])  # [H, b, K]
    picked = (dist * one_hot(y, G.shape[1])).sum(-1)  # [H, b]
    return masked_rows_mean(logsumexp(-dist) + picked, mask)  # CE(−dist, y)


@register
class FedTGP(FedAvg):
    name = "fedtgp"
    paper = (
        "Zhang et al., FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive Learning for "
        "Data and Model Heterogeneity in FL, AAAI 2024"
    )
    uploads = "local prototypes [K, proj_dim] + class counts [K] (no parameters)"
    fedavg_server = False  # prototypes travel, not parameters
    clients_hold_global = False  # nothing is shared: no server model
    settings = {
        "lam": Setting(10.0, "λ, weight of the distance to the global prototype (run_me.sh -lam 10)", lo=0),
        "tau": Setting(100.0, "τ, the adaptive margin's threshold (run_me.sh -mart 100)", lo=0),
        "server_lr": Setting(0.01, "the server's SGD step size on the TGP (the code's: the clients' -lr 0.01)", lo=0),
        "server_epochs": Setting(100, "S, the server's passes over the round's prototypes (run_me.sh -se 100)", lo=1),
    }

    def shared(self, name):
        return False

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state, rnd):
        ctx = super().context(state, rnd)
        ctx["prototypes"] = rnd.expand(state.server["prototypes"])  # [H, C, K, d]
        ctx["has"] = rnd.expand(state.server["has"])  # [H, C, K] bool
        return ctx

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        reg = masked_mean(proto_mse(z, y, ctx["prototypes"], ctx["has"]), mask)  # 0 before the first download
        return masked_ce(self.logits(params, z), y, mask) + ctx["hp"]["lam"] * reg, new_buffers

    def predict(self, params, buffers, x, ctx):
        """−φ(f_i(x), Ĝ^c), the squared distance averaged over the dimensions: the nearest global prototype wins."""
        z, _ = self.embed(params, buffers, x)
        mse = sq_distances(z, ctx["prototypes"]) / z.shape[-1]  # [N, K]
        return (-mse).masked_fill(~ctx["has"], float("-inf"))

    # -- server: state.server = TGP parameters [H, ...], "prototypes" Ĝ [H, K, d], "has" [H, K] ------------------
    def init_state(self, state, rnd):
        K, d = rnd.data.num_classes, self.cfg["proj_dim"]
        gens = [torch.Generator().manual_seed(int(s) * 1_000_003 + 7) for s in rnd.seeds.tolist()]  # not the model's
        models = [tgp_init(K, d, g) for g in gens]
        state.server = {k: torch.stack([m[k] for m in models]).to(rnd.device) for k in TGP}  # [H, ...]
        state.server["prototypes"] = torch.zeros(rnd.H, K, d, device=rnd.device)
        state.server["has"] = torch.zeros(rnd.H, K, dtype=torch.bool, device=rnd.device)

    def after_local(self, state, rnd):
        refresh_prototypes(self, state, rnd)  # the participants' P_i^c [H, C, K, d] and class counts [H, C, K]

    def upload(self, state, rnd):
        return {"protos": state.client["protos"], "counts": state.client["counts"]}

    def aggregate(self, uploads, weights, state, rnd):
        protos, counts = uploads["protos"], uploads["counts"] * rnd.part[..., None]  # [H, C, K, d], [H, C, K]
        margin = adaptive_margin(protos, counts, rnd.hp["tau"])  # [H]
        tgp = server_sgd(
            {k: state.server[k] for k in TGP},
            lambda p, x, y, mask: acl_loss(p, x, y, mask, margin),
            protos,
            counts > 0,
            rnd,
            rnd.hp["server_lr"],
            self.cfg["server_epochs"],
            self.cfg["batch_size"],
        )
        has = torch.ones_like(state.server["has"])  # the TGP generates every class
        return tgp | {"prototypes": tgp_prototypes(tgp).detach(), "has": has}

    def download(self, state, server, rnd):
        state.server = server

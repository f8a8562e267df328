"""FPL, Federated Prototypes Learning (Huang et al., "Rethinking Federated Learning with Domain Shift: A Prototype
View", CVPR 2023, §3): FedAvg plus cluster prototypes and unbiased prototypes. Released code: WenkeHuang/RethinkFL
@ 74201b37 (models/fpl.py, models/utils/federated_model.py, utils/finch.py).

Differences from FedAvg:
- each participant uploads its local prototypes c_i^k (class means of z, the projection output, as the release's
  `net.features`) and class counts besides the head;
- the server clusters each class's local prototypes of the round's participants with FINCH (Sarfraz et al.,
  "Efficient Parameter-free Clustering Using First Neighbor Relations", CVPR 2019; `finch` below) and keeps the means
  of the clusters of the last partition, the cluster prototypes C^k = {c^k_1, ...}, and their unweighted mean, the
  unbiased prototype u^k = 1/|C^k| Σ_j c^k_j; a class that no participant holds has none in the next round (the
  release rebuilds the set from the round's uploads);
- the local loss, for each row (z, y) whose class has prototypes, adds
      L_CPCL = −log Σ_{c∈C^y} e^{cos(z, c)/τ} / Σ_{k, c∈C^k} e^{cos(z, c)/τ}   (cluster-prototype contrast)
      L_UPCR = (1/d) ‖z − u^y‖²                                                (unbiased-prototype consistency)
  to the cross-entropy, averaged over the batch's rows (a row of a class without prototypes adds 0, and there are
  none in round 1): ℓ = L_CE + λ_c L_CPCL + λ_u L_UPCR, λ_c = λ_u = 1 (the paper's sum; the settings `cpcl` and `upcr`
  weight the terms for its ablations), τ = 0.02 (the release's infoNCET);
- the server averages the head by n_k (the release's averaing='weight'); every client predicts with it.
Choices the paper leaves open: L_UPCR averages the squared difference over the d dimensions (the release's
nn.MSELoss); local prototypes are the class means of the final local model's z over all of the client's training rows
in inference mode (the definition). `fpl-official` takes them as the release does: the class means of z over the last
local epoch's training batches, each z from the model as it was at that step. RethinkFL's SGD (lr 0.01, momentum 0.9,
weight decay 1e-5, batch 64, 10 local epochs) is a run setting, as for the other -official variants.
FINCH here follows utils/finch.py as the release calls it (cosine distance, ensure_early_exit=False, the last
partition, c[:, -1]): a class held by one participant has that prototype as its only cluster.
Global model: the averaged head, which every client holds after the download.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..training.config import Setting
from ..training.schedule import participants
from .base import FedAvg, logsumexp, masked_ce, masked_mean, one_hot
from .protos import refresh_prototypes
from .registry import register


# -- FINCH ----------------------------------------------------------------------------------------------------------
def first_neighbours(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """κ_i, each valid point's nearest other valid point of its group by cosine distance (the first index on ties;
    a point alone in its group, and an invalid one, is its own): x [G, n, d], valid [G, n] -> [G, n]."""
    u = F.normalize(x, dim=-1)
    dist = (1 - u @ u.mT).clamp(0, 2)  # [G, n, n] sklearn's cosine_distances
    n = x.shape[1]
    eye = torch.eye(n, dtype=torch.bool, device=x.device)
    dist = dist.masked_fill(eye, 1e12).masked_fill(~valid[:, None, :], float("inf"))  # finch.py: diagonal 1e12
    idx = torch.arange(n, device=x.device)
    return torch.where(valid, dist.argmin(-1), idx)


def components(kappa: torch.Tensor, steps: int) -> torch.Tensor:
    """The weakly connected components of the graphs i → κ_i [G, n] (FINCH's adjacency A(i, j) = 1 where j = κ_i,
    κ_j = i or κ_i = κ_j links exactly these): each node's label is the smallest index on its component's cycle.
    Pointer jumping, `steps` rounds with 2^steps ≥ n: q = κ^(2^steps) reaches the cycle and m its smallest node."""
    idx = torch.arange(kappa.shape[-1], device=kappa.device).expand_as(kappa)
    q, m = kappa, torch.minimum(idx, kappa)  # m(i): the smallest of i, κ(i), ..., κ^(2^t)(i)
    for _ in range(steps):
        m = torch.minimum(m, m.gather(-1, q))
        q = q.gather(-1, q)
    return m.gather(-1, q)  # [G, n]


def cluster_means(x: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of each cluster's points, at its label's slot: ([G, n, d], which slots hold a cluster [G, n])."""
    idx = torch.arange(x.shape[1], device=x.device)
    member = ((labels[..., None] == idx) & valid[..., None]).to(x.dtype)  # [G, n points, n slots]
    counts = member.sum(1)  # [G, n]
    return member.mT @ x / counts.clamp(min=1)[..., None], counts > 0


def finch(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """FINCH's last partition of each group's valid points x [G, n, d] (valid [G, n]): [G, n] the cluster of each
    point (the smallest node on its component's cycle). Partition 0 links every point to its first neighbour; each
    further partition links the clusters' means (of the points, as finch.py's cool_mean) to their first neighbours,
    at least halving the clusters, until one would be left: that one is not taken (finch.py drops it), so a group
    ends at its coarsest partition with more than one cluster, or at partition 0. Batched over the groups, no host
    read; ⌈log2 n⌉ levels reach every group's end."""
    n = x.shape[1]
    steps = max(1, (n - 1).bit_length())  # 2^steps >= n
    labels = components(first_neighbours(x, valid), steps)  # partition 0
    for _ in range(steps):
        means, alive = cluster_means(x, valid, labels)  # [G, n, d], [G, n]
        merged = components(first_neighbours(means, alive), steps)  # [G, n] each cluster's next cluster
        idx = torch.arange(n, device=x.device)
        more = (alive & (merged == idx)).sum(-1) > 1  # [G] the next partition has more than one cluster
        labels = torch.where(more[:, None], merged.gather(-1, labels), labels)
    return labels


def cluster_prototypes(protos: torch.Tensor, owned: torch.Tensor, slots: int) -> dict:
    """Each class's cluster prototypes from the participants' local prototypes protos [H, P, K, d] (owned [H, P, K]:
    the participant holds the class): {"clusters": [H, K, S, d], "valid": [H, K, S], "unbiased": [H, K, d]}, S =
    `slots` (at least the clusters any class can have: ⌊P/2⌋, or 1)."""
    H, P, K, d = protos.shape
    x = protos.permute(0, 2, 1, 3).reshape(H * K, P, d)  # [G, P, d] one group per class
    valid = owned.permute(0, 2, 1).reshape(H * K, P)  # [G, P]
    means, alive = cluster_means(x, valid, finch(x, valid))  # [G, P, d], [G, P]
    order = torch.argsort((~alive).to(torch.uint8), dim=-1, stable=True)[:, :slots]  # [G, S] the clusters first
    clusters = means.gather(1, order[..., None].expand(-1, -1, d)).reshape(H, K, slots, d)
    kept = alive.gather(1, order).reshape(H, K, slots)
    unbiased = (clusters * kept[..., None]).sum(2) / kept.sum(2).clamp(min=1)[..., None]  # [H, K, d] u^k
    return {"clusters": clusters, "valid": kept, "unbiased": unbiased}


# -- the losses -----------------------------------------------------------------------------------------------------
def cluster_contrast(z: torch.Tensor, y: torch.Tensor, clusters: torch.Tensor, valid: torch.Tensor, tau):
    """L_CPCL per row: −log Σ_{c∈C^y} e^{cos(z,c)/τ} / Σ_k Σ_{c∈C^k} e^{cos(z,c)/τ}, from z [N, d], clusters
    [K, S, d] and valid [K, S]: [N] (meaningless where class y has no cluster: the caller weights it 0)."""
    K, S, d = clusters.shape
    s = F.normalize(z, dim=-1) @ F.normalize(clusters.reshape(K * S, d), dim=-1).T / tau  # [N, K*S]
    s = s.masked_fill(~valid.reshape(K * S), float("-inf"))
    pos = (one_hot(y, K)[:, :, None] & valid).reshape(len(z), K * S)  # [N, K*S] the clusters of the row's class
    return logsumexp(s) - logsumexp(s.masked_fill(~pos, float("-inf")))


def unbiased_consistency(z: torch.Tensor, y: torch.Tensor, unbiased: torch.Tensor) -> torch.Tensor:
    """L_UPCR per row: (1/d) ‖z − u^y‖², unbiased [K, d]: [N]."""
    return ((z - one_hot(y, unbiased.shape[0]).to(z.dtype) @ unbiased) ** 2).mean(-1)


@register
class FPL(FedAvg):
    name = "fpl"
    paper = "Huang et al., Rethinking Federated Learning with Domain Shift: A Prototype View, CVPR 2023, §3"
    uploads = "all head parameters + local prototypes [K, proj_dim] + class counts [K]"
    fedavg_server = False  # prototypes travel with the parameters (after_local, ..., download)
    settings = {
        "tau": Setting(
            0.02, "τ, temperature of the cluster-prototype contrast (release: infoNCET)", lo=0, lo_open=True
        ),
        "cpcl": Setting(1.0, "λ_c, weight of the cluster-prototype contrast L_CPCL", lo=0),
        "upcr": Setting(1.0, "λ_u, weight of the unbiased-prototype consistency L_UPCR", lo=0),
    }

    def slots(self, C: int) -> int:
        """S, cluster prototypes kept per class: FINCH leaves at most ⌊P/2⌋ clusters of P ≥ 2 points."""
        return max(1, participants(C, self.cfg["participation"]) // 2)

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state, rnd):
        protos = state.server
        return super().context(state, rnd) | {
            "clusters": rnd.expand(protos["clusters"]),  # [H, C, K, S, d]
            "valid": rnd.expand(protos["valid"]),  # [H, C, K, S]
            "unbiased": rnd.expand(protos["unbiased"]),  # [H, C, K, d]
        }

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return self.fpl_loss(params, z, y, mask, ctx), new_buffers

    def fpl_loss(self, params, z, y, mask, ctx):
        """L_CE + λ_c L_CPCL + λ_u L_UPCR, the batch's mean, from its embeddings z [B, d]."""
        hp, valid = ctx["hp"], ctx["valid"]
        has = (one_hot(y, valid.shape[0]) & valid.any(-1)).any(-1)  # [B] the row's class has prototypes
        terms = hp["cpcl"] * cluster_contrast(z, y, ctx["clusters"], valid, hp["tau"])
        terms = terms + hp["upcr"] * unbiased_consistency(z, y, ctx["unbiased"])  # [B]
        return masked_ce(self.logits(params, z), y, mask) + masked_mean(torch.where(has, terms, 0.0), mask)

    # -- server: state.server = cluster_prototypes' dict ----------------------------------------------------------
    def init_state(self, state, rnd):
        H, K, S, d, dev = rnd.H, rnd.data.num_classes, self.slots(rnd.C), self.cfg["proj_dim"], rnd.device
        state.server = {
            "clusters": torch.zeros(H, K, S, d, device=dev),
            "valid": torch.zeros(H, K, S, dtype=torch.bool, device=dev),  # none before round 1
            "unbiased": torch.zeros(H, K, d, device=dev),
        }

    def after_local(self, state, rnd):
        refresh_prototypes(self, state, rnd)

    def upload(self, state, rnd):
        return super().upload(state, rnd) | {"protos": state.client["protos"], "counts": state.client["counts"]}

    def aggregate(self, uploads, weights, state, rnd):
        model = super().aggregate(
            {k: v for k, v in uploads.items() if k not in ("protos", "counts")}, weights, state, rnd
        )
        protos, owned = uploads["protos"], (uploads["counts"] > 0) & rnd.part[..., None]  # [H, C, K, d], [H, C, K]
        if rnd.clients is not None:  # the P participants' only
            h = torch.arange(rnd.H, device=rnd.device)[:, None]
            protos, owned = protos[h, rnd.clients], owned[h, rnd.clients]  # [H, P, K, d], [H, P, K]
        return {"model": model, "protos": cluster_prototypes(protos, owned, self.slots(rnd.C))}

    def download(self, state, server, rnd):
        super().download(state, server["model"], rnd)
        state.server = server["protos"]


@register
class FPLOfficial(FPL):
    """FPL as released: local prototypes from the last local epoch's training batches while the model trains.

    Each step adds its batch's z (from the model before that step's update, in training mode) to the running class
    sums in the buffers proto_sum [K, d] and proto_count [K], in the last local epoch only (ctx["collect"]); after_local
    turns them into the uploaded prototypes and zeroes them (they are zero whenever the head travels)."""

    name = "fpl-official"
    paper = "FPL released code (WenkeHuang/RethinkFL, models/fpl.py, models/utils/federated_model.py, utils/finch.py)"
    settings = {}  # FPL's; the released SGD: --set optimizer=sgd momentum=0.9 weight_decay=1e-5 lr=0.01

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        sums = {"proto_sum": torch.zeros(num_classes, cfg["proj_dim"]), "proto_count": torch.zeros(num_classes)}
        return params, buffers | sums

    def context(self, state, rnd):
        last = float(rnd.epoch == self.local_epochs() - 1)  # agg_protos_label: the last local epoch's batches
        return super().context(state, rnd) | {"collect": torch.full((rnd.H, rnd.C), last, device=rnd.device)}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        rows = (one_hot(y, buffers["proto_count"].shape[0]) & mask[:, None]).to(z.dtype) * ctx["collect"]  # [B, K]
        sums = {
            "proto_sum": buffers["proto_sum"] + rows.T @ z.detach(),  # [K, d]
            "proto_count": buffers["proto_count"] + rows.sum(0),  # [K]
        }
        return self.fpl_loss(params, z, y, mask, ctx), new_buffers | sums

    def after_local(self, state, rnd):
        counts = state.buffers["proto_count"]  # [H, C, K]
        state.client["protos"] = state.buffers["proto_sum"] / counts.clamp(min=1)[..., None]  # [H, C, K, d]
        state.client["counts"] = counts.clone()
        state.buffers = state.buffers | {k: torch.zeros_like(state.buffers[k]) for k in ("proto_sum", "proto_count")}

    def upload(self, state, rnd):
        sent = super().upload(state, rnd)
        return {k: v for k, v in sent.items() if k not in ("proto_sum", "proto_count")}  # zero between rounds

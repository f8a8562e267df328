"""FedPCL (Tan et al., "Federated Learning from Pre-Trained Models: A Contrastive Learning Approach", NeurIPS 2022;
§4, eq. 5–10, Alg. 1): prototype-wise contrastive learning.

Differences from FedAvg: the head is only the projection network FC(D, 256) + ReLU + BN (Table 7, no classifier);
nothing parametric is uploaded, only the local prototypes (eq. 5) and their class counts; the server builds global
prototypes (eq. 6) and pads every local set (eq. 7); the local loss is L_g + L_p (eq. 8–10, τ = 0.07); inference is the
nearest local prototype by inner product. Before round 1 the prototypes of the initial networks are exchanged once
(Alg. 1 line 1, "initialize prototype sets").

`fedpcl-official` matches the released code (yuetan031/FedPCL lib/losses.py ConLoss, lib/update.py):
no BN, L2-normalised z, only the local-prototype term written as the code writes it (each client's prototype of the
sample's class is the anchor, contrasted against the batch's features, same-label samples positive, summed over the
clients' sets) on the code's two-view batch (update_weights_lg concatenates images[0] and images[1], n_views = 2; on
Digit-5/Office-10 the two crops are identical, so the cached batch is duplicated: every anchor has its own copy as a
positive and the denominator doubles), zero loss in round 0 (the code trains only once global prototypes exist; in
round 0 only weight decay acts), global prototypes as the unweighted mean over owning clients, inference by the
smallest squared distance to the client's own prototypes, and local prototypes from one pass of the reshuffled
drop_last training loader (⌊n/B⌋·B random rows, seeded from the run's seed: `protos.loader_rows`), not all rows.
(Contrasting two different cached views instead would need the trainer to load views for this algorithm; it does not.)

Eq. 6 is implemented literally (`global_agg="eq6"`): the size-weighted mean is divided once more by |N_j|, so global
prototypes are 1/|N_j| the length of local ones; `global_agg="mean"` is the plain mean over owning clients.
Ablations: terms=global|local (Table 6); loss=supcon (Table 5). Table 5's other rows, "Cross Entropy" and
"CE + ProtoDist", are FedAvg and FedProto: the paper's numbers for them equal those in Table 11.
Global model: none. The server holds only prototypes; every client keeps its own projection network.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..training.config import Setting
from .registry import register
from .base import FedAvg, logsumexp, masked_mean, one_hot
from .protos import (
    NOISE_SETTINGS,
    global_prototypes,
    loader_prototypes,
    mean_prototypes,
    pad_prototypes,
    privatize,
    refresh_prototypes,
)


def proto_contrast(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, tau) -> torch.Tensor:
    """Eq. 8 per sample: -log exp(z·C^y/τ) / Σ_{a≠y} exp(z·C^a/τ).

    protos [K, d] -> [N]; a stack of prototype sets [P, K, d] -> [P, N] (eq. 9's sets, in one matmul)."""
    K, d = protos.shape[-2:]
    s = (z @ protos.reshape(-1, d).T / tau).reshape(len(z), -1, K).movedim(1, 0)  # [P, N, K]
    s = s[0] if protos.dim() == 2 else s  # [N, K] for a single set
    pos = one_hot(y, K)  # [N, K]
    return -(s * pos).sum(-1) + logsumexp(s.masked_fill(pos, float("-inf")))


CHUNK = 2**14  # elements one model's chunk of prototype sets may hold per intermediate (64 KiB in float32)


def sum_over_sets(term, z, y, mask, sets, tau, width: int, rows: bool) -> torch.Tensor:
    """Σ_p term(z, y, mask, sets, τ)[p] -> [N], a few of the prototype sets [P, K, d] at a time, so that every client's
    batch contrasts against every client's sets in memory bounded at any client count. `term` gives [P', N] for P'
    sets, its largest intermediate holding `width` elements per set; `rows`: each row's term depends on its own z
    only. Sets that fit in one chunk go in one plain call."""
    n = max(1, CHUNK // width)  # sets per chunk: from shapes only (nothing read from the device)
    if len(sets) <= n:
        return term(z, y, mask, sets, tau).sum(0)
    return _SetChunks.apply(term, n, rows, z, y, mask, sets, tau)[0]


class _SetChunks(torch.autograd.Function):
    """`sum_over_sets` chunk by chunk, keeping no chunk's intermediates. With `rows`, the forward also sums each row's
    gradient dz [N, d] (the vector-Jacobian product with ones) and the backward scales it; otherwise the backward
    recomputes each chunk's vector-Jacobian product. First derivatives only, for z only: the prototype sets and τ are
    constants."""

    generate_vmap_rule = True  # the engine vmaps local_loss over its [H, C] models

    @staticmethod
    def forward(term, n, rows, z, y, mask, sets, tau):
        out, dz = 0, torch.zeros_like(z)  # [N], [N, d]
        for part in sets.split(n):
            if rows:
                o, vjp = torch.func.vjp(lambda z: term(z, y, mask, part, tau).sum(0), z)  # [N]
                dz = dz + vjp(torch.ones_like(o))[0]
            else:
                o = term(z, y, mask, part, tau).sum(0)  # [N]
            out = out + o
        return out, dz

    @staticmethod
    def setup_context(ctx, inputs, output):
        if any(ctx.needs_input_grad[6:]):
            raise ValueError("sum_over_sets differentiates z only: the prototype sets and τ must be constants")
        ctx.term, ctx.n, ctx.rows = inputs[:3]
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1], *inputs[3:])

    @staticmethod
    def backward(ctx, grad, _):  # grad [N]
        dz, z, y, mask, sets, tau = ctx.saved_tensors
        if ctx.rows:
            return None, None, None, grad[:, None] * dz, None, None, None, None
        dz = torch.zeros_like(z)  # [N, d]
        for part in sets.split(ctx.n):
            _, vjp = torch.func.vjp(lambda z: ctx.term(z, y, mask, part, tau).sum(0), z)
            dz = dz + vjp(grad)[0]
        return None, None, None, dz, None, None, None, None


def supcon(z: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, tau) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al. 2020) over one batch's embeddings, one view: [N]."""
    zn = F.normalize(z, dim=-1)
    s = zn @ zn.T / tau  # [N, N]
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    valid = mask[None, :] & ~eye  # [N, N]
    pos = (y[:, None] == y[None, :]) & valid
    log_prob = s - logsumexp(s.masked_fill(~valid, float("-inf")), keepdim=True)
    n_pos = pos.float().sum(-1)
    return -(log_prob * pos).sum(-1) / n_pos.clamp(min=1) * (n_pos > 0)


def pcl_term(z, y, mask, sets, tau) -> torch.Tensor:
    """Eq. 9's summand for every set [P, K, d]: [P, N] (`sum_over_sets`' form of `proto_contrast`)."""
    return proto_contrast(z, y, sets, tau)


def conloss(z, y, mask, sets, tau) -> torch.Tensor:
    """The released ConLoss (lib/losses.py) per set [P, K, d] on the released batch of two views (update_weights_lg:
    torch.cat([images[0], images[1]]), n_views = 2; the two crops are identical on the cached features, so the batch
    is duplicated): 2N anchors C_p^{y_i} against the 2N features, positives the same-label features except the
    anchor's own position (the sample's copy in the other view is one). Returns [P, 2N]."""
    N = len(z)
    z2, y2, mask2 = torch.cat([z, z]), torch.cat([y, y]), torch.cat([mask, mask])  # [2N, d], [2N], [2N]
    anchors = sets[:, y2.clamp(min=0)]  # [P, 2N, d]
    s = torch.matmul(anchors, z2.T) / tau  # [P, 2N, 2N]
    eye = torch.eye(2 * N, dtype=torch.bool, device=z.device)
    valid = mask2[None, :] & ~eye  # [2N, 2N]
    pos = (y2[:, None] == y2[None, :]) & valid
    log_prob = s - logsumexp(s.masked_fill(~valid, float("-inf")), keepdim=True)  # [P, 2N, 2N]
    n_pos = pos.float().sum(-1)  # [2N]
    return -(log_prob * pos).sum(-1) / n_pos.clamp(min=1) * (n_pos > 0)  # [P, 2N]


@register
class FedPCL(FedAvg):
    name = "fedpcl"
    paper = (
        "Tan et al., Federated Learning from Pre-Trained Models: A Contrastive Learning Approach, NeurIPS 2022, "
        "§4 eq. 5–10, Alg. 1"
    )
    uploads = "local prototypes [K, proj_dim] + class counts [K]"
    personal_predict = True  # the own projection and the own local prototypes
    fedavg_server = False  # prototypes travel, not parameters
    clients_hold_global = False  # the projection stays on the client: no complete server model
    objective = (
        "unbounded below: eq. 8 leaves the positive out of its denominator and z is not normalised, so the "
        "loss can fall without limit while accuracy holds; judge runs by accuracy "
        "(--set normalize=true bounds it)"
    )
    objective_when = {"normalize": False, "loss": "pcl"}
    settings = {
        "bn": True,  # Table 7: FC + ReLU + BN
        "normalize": Setting(False, "L2-normalise the projection output z"),
        "tau": Setting(0.07, "τ, the contrastive temperature (eq. 8-9)", lo=0, lo_open=True),
        "terms": Setting("both", "which prototype terms the loss has (Table 6)", choices=("both", "global", "local")),
        "loss": Setting(
            "pcl", "pcl (eq. 10), supcon (Table 5) or the released code's", choices=("pcl", "supcon", "official")
        ),
        "global_agg": Setting(
            "eq6", "global prototypes by eq. 6 as written, or the plain mean", choices=("eq6", "mean")
        ),
        **NOISE_SETTINGS,
    }

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        return {k: v for k, v in params.items() if not k.startswith("cls")}, buffers  # no classifier

    def embed(self, params, buffers, x, mask=None, train=False):
        z, new = super().embed(params, buffers, x, mask, train)
        return (F.normalize(z, dim=-1) if self.cfg["normalize"] else z), new

    def shared(self, name):
        return False

    # -- prototypes ---------------------------------------------------------------------------------------------
    # state.server: "prototypes" [H, K, d] the global prototypes (eq. 6); "padded" [H, C, K, d] every client's
    # local set padded with them (eq. 7)
    def init_state(self, state, rnd):
        self.after_local(state, rnd)  # Alg. 1 line 1: the initial networks' prototypes, exchanged once
        weights = rnd.data.counts[None].float().expand(rnd.H, -1)  # [H, C] everyone (rnd.part is all True)
        state.server = self.aggregate(self.upload(state, rnd), weights, state, rnd)

    def after_local(self, state, rnd):
        refresh_prototypes(self, state, rnd)

    def upload(self, state, rnd):
        return {"protos": privatize(state.client["protos"], rnd), "counts": state.client["counts"]}

    def aggregate(self, uploads, weights, state, rnd):
        part = rnd.part[..., None]  # [H, C, 1]
        counts = uploads["counts"] * part  # [H, C, K]
        glob = GLOBAL_AGG[self.cfg["global_agg"]](uploads["protos"], counts)  # [H, K, d]
        if "prototypes" in state.server:  # a class no participant holds this round keeps its last global prototype
            glob = torch.where(counts.sum(1)[..., None] > 0, glob, state.server["prototypes"])
        padded = pad_prototypes(uploads["protos"], counts, glob)  # [H, C, K, d]
        if "padded" in state.server:  # clients that sat this round out keep their last prototypes
            padded = torch.where(part[..., None], padded, state.server["padded"])
        return {"prototypes": glob, "padded": padded}

    def download(self, state, server, rnd):
        state.server = server

    # -- client ---------------------------------------------------------------------------------------------------
    def context(self, state, rnd):
        ctx = super().context(state, rnd)
        ctx["prototypes"] = rnd.expand(state.server["prototypes"])  # [H, C, K, d]
        ctx["padded"] = rnd.expand(state.server["padded"])  # [H, C, C, K, d]  every client's padded set
        ctx["own"] = state.client["protos"]  # [H, C, K, d]  for inference
        ctx["own_counts"] = state.client["counts"]  # [H, C, K]
        return ctx

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return masked_mean(LOSSES[self.cfg["loss"]](self, params, z, y, mask, ctx), mask), new_buffers

    def pcl(self, params, z, y, mask, ctx):
        tau, terms = ctx["hp"]["tau"], self.cfg["terms"]
        l_g = proto_contrast(z, y, ctx["prototypes"], tau)  # eq. 8
        sets = ctx["padded"]  # [C, K, d] every client's padded set; eq. 9 is the mean over them
        l_p = sum_over_sets(pcl_term, z, y, mask, sets, tau, len(z) * sets.shape[1], rows=True) / len(sets)  # eq. 9
        return {"both": l_g + l_p, "global": l_g, "local": l_p}[terms]  # eq. 10

    def predict(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        scores = z @ ctx["own"].T  # [N, K] similarity to the client's own local prototypes
        return scores.masked_fill(ctx["own_counts"] == 0, float("-inf"))

    def official(self, params, z, y, mask, ctx):
        """Released ConLoss on the released batch of two views, summed over the clients' sets (`conloss`). Returns
        [N]: the mean of a row's two anchors, so the masked mean over rows is the code's mean over the 2N anchors."""
        N, d = z.shape
        width = (2 * N) * max(2 * N, d)  # one set's anchors [2N, d] and scores [2N, 2N]
        per_anchor = sum_over_sets(conloss, z, y, mask, ctx["padded"], ctx["hp"]["tau"], width, rows=False)
        return per_anchor.reshape(2, N).mean(0)


GLOBAL_AGG = {"eq6": global_prototypes, "mean": mean_prototypes}

LOSSES = {
    "pcl": FedPCL.pcl,
    "official": FedPCL.official,
    "supcon": lambda self, params, z, y, mask, ctx: supcon(z, y, mask, ctx["hp"]["tau"]),
}


@register
class FedPCLOfficial(FedPCL):
    name = "fedpcl-official"
    paper = "FedPCL released code (yuetan031/FedPCL, lib/losses.py ConLoss, lib/update.py)"
    settings = {"bn": False, "normalize": True, "loss": "official", "global_agg": "mean"}
    personal_predict = False  # every client's own prototypes are taken again each round, over a reshuffled loader

    def context(self, state, rnd):
        started = torch.full((rnd.H, rnd.C), float(rnd.round > 0), device=rnd.device)  # [H, C]
        return super().context(state, rnd) | {"started": started}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        """Zero in round 0 (the released code has no global prototypes yet: loss2 = 0, only weight decay acts)."""
        loss, new_buffers = super().local_loss(params, buffers, x, y, mask, ctx)
        return loss * ctx["started"], new_buffers

    def after_local(self, state, rnd):
        state.client["protos"], state.client["counts"] = loader_prototypes(self, state, rnd)

    def predict(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        dist = ((z[:, None] - ctx["own"][None]) ** 2).sum(-1)  # [N, K] squared distance to own prototypes
        return (-dist).masked_fill(ctx["own_counts"] == 0, float("-inf"))

"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022; the
"CE + ProtoDist" baseline [24] of Tan et al., FedPCL, NeurIPS 2022, Tables 2–5). Official code: yuetan031/FedProto.

Differences from FedAvg:
- no parameter is shared: every client keeps its own head (projection + classifier);
- a client uploads its local prototypes (class means of the projection output z on its training data, after local
  training) and class counts; the server averages each class's prototypes over the clients that own it (unweighted,
  as the official `proto_aggregation`); a class that no participant of the round owns keeps its last global prototype;
- the local loss adds λ·d(z, C̄^y) to the cross-entropy, d = squared L2 distance averaged over the feature dimensions
  (the official code's nn.MSELoss, so that its λ = 1 keeps its scale); a row whose class has no global prototype yet
  (every row in round 1) adds 0, through a weight tensor;
- inference: the client's own classifier (infer="classifier", how the official code evaluates) or the nearest global
  prototype (infer="proto", the official test_inference_new_het_lt): only the classes the client holds in its
  training split and that have a global prototype are candidates, at distance nn.MSELoss (the squared L2 distance
  averaged over the dimensions); every other class sits at the code's fixed distance 100 (so it wins only when every
  candidate is farther than 100, as in the code); infer="proto-all" is PFLlib's reading: every class with a global
  prototype, by squared L2 distance.
Prototype noise (proto_noise=laplace|gaussian) follows FedPCL's privacy study (NeurIPS 2022, App. A.2.4, Table 15).
Global model: none. The server holds only the global prototypes; every client keeps its own head.

Differs from the official code in one place: it averages the z of every training batch while the model moves; here
the prototypes are the class means of the final local model's z (the definition FedPCL's eq. 5 uses).
`fedproto-official` does what the released code (lib/update.py update_weights_het) does: prototypes are the class
means of z over the last local epoch's training batches, each z from the model as it was at that step.
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .registry import register
from .base import FedAvg, masked_ce, masked_mean, one_hot
from .protos import NOISE_SETTINGS, empty_global, privatize, refresh_prototypes, sq_distances, update_global


def proto_distance(z: torch.Tensor, y: torch.Tensor, glob: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """Per row 1/d·||z − C̄^y||², or 0 where class y has no global prototype (or y is padding): [N]."""
    onehot = one_hot(y, glob.shape[0]).float()  # [N, K]
    target = onehot @ glob  # [N, d]
    return ((z - target) ** 2).mean(-1) * (onehot @ has.float())


@register
class FedProto(FedAvg):
    name = "fedproto"
    paper = "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022"
    uploads = "local prototypes [K, proj_dim] + class counts [K] (no parameters)"
    fedavg_server = False  # prototypes travel, not parameters
    clients_hold_global = False  # nothing is shared: no server model
    settings = {
        "lam": Setting(1.0, "λ, weight of the prototype distance (official ld = 1)", lo=0),
        "infer": Setting(
            "classifier",
            "predict with the own classifier (official) or the nearest global prototype",
            choices=("classifier", "proto", "proto-all"),
        ),
        **NOISE_SETTINGS,  # as FedPCL (NeurIPS 2022, Table 15)
    }

    def shared(self, name):
        return False

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state, rnd):
        ctx = super().context(state, rnd)
        ctx["prototypes"] = rnd.expand(state.server["prototypes"])  # [H, C, K, d]
        ctx["has"] = rnd.expand(state.server["has"])  # [H, C, K] bool
        ctx["own_classes"] = state.client["own_classes"]  # [H, C, K] bool: classes in the client's training split
        return ctx

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return self.proto_loss(params, z, y, mask, ctx), new_buffers

    def proto_loss(self, params, z, y, mask, ctx):
        """CE + λ·d(z, C̄^y), the batch's mean, from its embeddings z [B, d]."""
        reg = masked_mean(proto_distance(z, y, ctx["prototypes"], ctx["has"]), mask)
        return masked_ce(self.logits(params, z), y, mask) + ctx["hp"]["lam"] * reg

    @property  # a capability that follows a setting (base.py allows a property)
    def personal_predict(self) -> bool:  # type: ignore[override]
        return self.cfg["infer"] == "classifier"  # the nearest global prototype changes with every round

    def predict(self, params, buffers, x, ctx):
        return INFER[self.cfg["infer"]](self, params, buffers, x, ctx)

    def nearest_prototype(self, params, buffers, x, ctx):
        """Released: −MSE to the global prototypes of the client's own classes, −100 for every other class."""
        z, _ = self.embed(params, buffers, x)
        mse = sq_distances(z, ctx["prototypes"]) / z.shape[-1]  # [N, K]
        return (-mse).masked_fill(~(ctx["has"] & ctx["own_classes"]), -100.0)

    def nearest_prototype_all(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        return (-sq_distances(z, ctx["prototypes"])).masked_fill(~ctx["has"], float("-inf"))  # [N, K]

    # -- server: state.server = {"prototypes": [H, K, d], "has": [H, K]} ------------------------------------------
    def init_state(self, state, rnd):
        state.server = empty_global(rnd, self.cfg["proj_dim"])
        data = rnd.data
        own = (one_hot(data.labels, data.num_classes) & data.mask[..., None]).any(1)  # [C, K]
        state.client["own_classes"] = own.expand(rnd.H, *own.shape)  # [H, C, K]

    def after_local(self, state, rnd):
        refresh_prototypes(self, state, rnd)

    def upload(self, state, rnd):
        return {"protos": privatize(state.client["protos"], rnd), "counts": state.client["counts"]}  # [H, C, K, d]

    def aggregate(self, uploads, weights, state, rnd):
        return update_global(uploads["protos"], uploads["counts"], rnd.part, state.server)

    def download(self, state, server, rnd):
        state.server = server


INFER = {"classifier": FedAvg.predict, "proto": FedProto.nearest_prototype, "proto-all": FedProto.nearest_prototype_all}


@register
class FedProtoOfficial(FedProto):
    """FedProto as released: prototypes from the last local epoch's training batches while the model trains.

    Each step adds its batch's z (from the model before that step's update) to the running class sums in the buffers
    proto_sum [K, d] and proto_count [K], in the last local epoch only (ctx["collect"]); after_local turns them into
    the uploaded prototypes and zeroes them. The server rebuilds the global set from the round's prototypes alone
    (proto_aggregation): a class no participant sent this round has no global prototype in the next."""

    name = "fedproto-official"
    paper = "FedProto released code (yuetan031/FedProto, lib/update.py update_weights_het, lib/utils.py)"
    settings = {}  # FedProto's (λ = ld = 1); the released SGD (momentum 0.5, lr 0.01) is a run setting, as for the
    # other -official variants: --set optimizer=sgd momentum=0.5 weight_decay=0 lr=0.01

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        sums = {"proto_sum": torch.zeros(num_classes, cfg["proj_dim"]), "proto_count": torch.zeros(num_classes)}
        return params, buffers | sums

    def context(self, state, rnd):
        last = float(rnd.epoch == self.local_epochs() - 1)  # agg_protos_label is reset at every epoch's start
        return super().context(state, rnd) | {"collect": torch.full((rnd.H, rnd.C), last, device=rnd.device)}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        rows = (one_hot(y, buffers["proto_count"].shape[0]) & mask[:, None]).float() * ctx["collect"]  # [B, K]
        sums = {
            "proto_sum": buffers["proto_sum"] + rows.T @ z.detach(),  # [K, d]
            "proto_count": buffers["proto_count"] + rows.sum(0),
        }  # [K]
        return self.proto_loss(params, z, y, mask, ctx), new_buffers | sums

    def after_local(self, state, rnd):
        counts = state.buffers["proto_count"]  # [H, C, K]
        state.client["protos"] = state.buffers["proto_sum"] / counts.clamp(min=1)[..., None]  # [H, C, K, d]
        state.client["counts"] = counts.clone()  # the buffers are the step runner's, refilled next round
        state.buffers = state.buffers | {k: torch.zeros_like(state.buffers[k]) for k in ("proto_sum", "proto_count")}

    def aggregate(self, uploads, weights, state, rnd):
        return update_global(uploads["protos"], uploads["counts"], rnd.part, empty_global(rnd, self.cfg["proj_dim"]))

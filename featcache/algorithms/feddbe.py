"""FedDBE (Zhang et al., "Eliminating Domain Bias for Federated Learning in Representation Space", NeurIPS 2023):
FedAvg with the Domain Bias Eliminator, DBE = PRBM + MR. Followed as PFLlib releases it (TsingZ0/PFLlib @ d832e76f,
system/flcore/clients/clientdbe.py, system/flcore/servers/serverdbe.py; the same code as the authors' TsingZ0/DBE).

The head splits into the feature extractor (the projection, z = ReLU(W x + b) [+ BN]: PFLlib's `model.base`) and the
classifier (PFLlib's `model.head`). Differences from FedAvg:
- PRBM, the personalized representation bias memory: a trainable vector z̄ᵖ_i [proj_dim] per client, added to every
  representation before the classifier, logits = head(z + z̄ᵖ_i); it starts at 0, trains with the head on the same
  loss and never leaves the client;
- MR, the mean regularization: each step keeps a running mean of the client's representations,
  z̄_i ← (1 − μ) z̄_i + μ · mean_B(z) (reset to 0 when a round's local training starts; the gradient flows through
  this step's batch mean, the earlier steps' part is a constant), and the loss is
      ℓ = CE(head(z + z̄ᵖ_i), y) + κ · (1/d) Σ_j ½ (z̄_{i,j} − z̄ᵍ_j)²,
  z̄ᵍ the consensus global mean (the released `torch.mean(0.5 * (running_mean - global_mean)**2)`);
- the initialization period: before federated training every client trains once without DBE (cross-entropy of
  head(z), no PRBM, no MR) while keeping z̄_i; the server takes z̄ᵍ = Σ_i n_i/n · z̄_i and fixes it for the rest of
  the run; the models trained in that period are discarded (the next send_models hands every client the initial
  model again). Here round 1 (rnd.round = 0) is that period: its participants train without DBE, the server averages
  their running means by n_k into z̄ᵍ and every client takes the initial model back, so R rounds are R − 1 rounds of
  DBE (PFLlib runs global_rounds + 1 after its initialization) and round 1's evaluation scores the initial model, as
  PFLlib's first evaluation does;
- the server averages every head parameter by n_k (FedAvg); each client predicts with head(z + z̄ᵖ_i).
κ = 50 and μ = 1 (the running mean is the current batch's mean) are the authors' run_me.sh (TsingZ0/DBE @ 193f4355:
-klw 50 -mo 1); PFLlib's defaults, κ = 0 and μ = 0.1, turn MR off.
Choices left open and deviations from the release: PRBM trains with the run's local optimizer and settings (the release:
its own plain SGD at the head's rate, which is the same update under plain SGD without weight decay); with partial
participation the initialization period is round 1's participants (PFLlib: every client); with bn=True the BN
statistics are averaged with the parameters (PFLlib averages `parameters()` only: each client keeps its own).
Global model: the averaged head without any PRBM, head(z) (the shared feature extractor and classifier).
"""

from __future__ import annotations

import torch

from ..training.config import Setting
from .base import FedAvg, masked_ce, weighted_mean
from .registry import register

PRBM, MEAN = "prbm", "dbe_mean"  # the personal bias z̄ᵖ_i (a parameter), the running mean z̄_i (a buffer)


def running_mean(z: torch.Tensor, mask: torch.Tensor, previous: torch.Tensor, mu) -> torch.Tensor:
    """(1 − μ) z̄_i + μ · mean of z [B, d] over the batch's real rows: [d]."""
    m = mask.to(z.dtype)[:, None]  # [B, 1]
    return (1 - mu) * previous + mu * (m * z).sum(0) / m.sum().clamp(min=1)


def mean_regularization(running: torch.Tensor, global_mean: torch.Tensor) -> torch.Tensor:
    """MR: (1/d) Σ_j ½ (z̄_{i,j} − z̄ᵍ_j)², a scalar."""
    return (0.5 * (running - global_mean) ** 2).mean()


@register
class FedDBE(FedAvg):
    name = "feddbe"
    paper = "Zhang et al., Eliminating Domain Bias for Federated Learning in Representation Space, NeurIPS 2023"
    uploads = "all head parameters, not the PRBM (round 1, the initialization period: the running mean [proj_dim])"
    fedavg_server = False  # the initialization period's server step (upload, aggregate, download)
    clients_hold_global = False  # clients predict with their PRBM added; the global model has none
    settings = {
        "kappa": Setting(50.0, "κ, weight of the mean regularization (authors' run_me.sh: -klw 50)", lo=0),
        "mu": Setting(1.0, "μ, momentum of the running mean of z (authors' run_me.sh: -mo 1)", lo=0, hi=1),
    }

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        d = cfg["proj_dim"]
        return params | {PRBM: torch.zeros(d)}, buffers | {MEAN: torch.zeros(d)}

    def shared(self, name):
        return name not in (PRBM, MEAN)

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state, rnd):
        server = state.server
        return super().context(state, rnd) | {
            "global_mean": rnd.expand(server["global_mean"]),  # [H, C, d] z̄ᵍ
            "dbe": rnd.expand(server["dbe"]),  # [H, C] 0 in the initialization period, then 1
        }

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)  # [B, d]
        hp, dbe = ctx["hp"], ctx["dbe"]
        running = running_mean(z, mask, buffers[MEAN], hp["mu"])  # [d]
        ce = masked_ce(self.logits(params, z + dbe * params[PRBM]), y, mask)
        loss = ce + dbe * hp["kappa"] * mean_regularization(running, ctx["global_mean"])
        return loss, new_buffers | {MEAN: running.detach()}

    def predict(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        return self.logits(params, z + params[PRBM])

    # -- server: state.server = {"global_mean": [H, d], "dbe": [H], "initial": w⁰ name -> [H, ...]} ------------------
    def init_state(self, state, rnd):
        d, dev = self.cfg["proj_dim"], rnd.device
        initial = {k: v[:, 0].clone() for k, v in (state.params | state.buffers).items() if self.shared(k)}
        zeros = torch.zeros(rnd.H, d, device=dev)
        # w⁰ stays for the whole run: a checkpoint's state holds the same names and shapes at every round
        state.server = {"global_mean": zeros, "dbe": torch.zeros(rnd.H, device=dev), "initial": initial}

    def upload(self, state, rnd):
        if rnd.round == 0:  # the initialization period: the running means alone
            return {"running": state.buffers[MEAN]}  # [H, C, d]
        return super().upload(state, rnd)

    def aggregate(self, uploads, weights, state, rnd):
        if rnd.round == 0:
            return {"global_mean": weighted_mean(uploads["running"], weights)}  # [H, d] z̄ᵍ = Σ n_i/n z̄_i
        return super().aggregate(uploads, weights, state, rnd)

    def download(self, state, server, rnd):
        if "global_mean" in server:  # the end of the initialization period: z̄ᵍ fixed, every client back to w⁰
            super().download(state, {k: v.clone() for k, v in state.server["initial"].items()}, rnd)
            ones = torch.ones(rnd.H, device=rnd.device)
            state.server = state.server | {"global_mean": server["global_mean"], "dbe": ones}
        else:
            super().download(state, server, rnd)
        state.buffers = state.buffers | {MEAN: torch.zeros_like(state.buffers[MEAN])}  # reset_running_stats

    # -- the global model ---------------------------------------------------------------------------------------
    def global_model(self, state, rnd):
        """The averaged feature extractor and classifier (every client holds them after the download)."""
        pick = lambda d: {k: v[:, 0] for k, v in d.items() if self.shared(k)}  # [H, ...]
        return pick(state.params), pick(state.buffers)

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # head(z): no PRBM

"""FedBABU (Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification", ICLR 2022,
§3, Alg. 1).

The model is a body f(·; θ_b) (here the projection network, with its BN when bn=True) and a head h(·; θ_h) (here the
classifier). Differences from FedAvg:
- federated training updates and averages the body only: the head keeps its random initialisation θ_h^0, the same
  on every client, and never changes; a local step is θ_b ← θ_b − η ∇_{θ_b} CE(h(f(x; θ_b); θ_h^0), y) and the
  server takes θ_b ← Σ_{k∈S} n_k / n_S · θ_{b,k} over the participants S (BN statistics travel with the body);
- evaluation (personalization): each client fine-tunes the global model (θ_b, θ_h^0) on its own training rows for
  τ_f = `finetune_epochs` epochs of minibatch SGD with momentum (`finetune_lr`, `finetune_momentum`; the engine's
  batch_size and drop_last), then predicts with the fine-tuned model. `finetune` = "full" tunes body and head (the
  paper's experiments and its code, jhoon-oh/FedBABU @ e34c15b4 `analysis.ipynb`; PFLlib's `clientBABU.fine_tune`);
  "head" tunes the head alone (the abstract's wording).
Choices the paper leaves open: the fine-tuning runs at every evaluation, from the model the client holds after the
download, and is discarded after scoring (FL-bench's test-time fine-tuning; the paper fine-tunes once, after
training); its minibatches are permutations hashed from (seed, round, epoch, row) for epochs local_epochs …
local_epochs + τ_f − 1 of the round (apart from the training's; one stream for every client, so a Flower client alone
draws them too: clients with as many rows permute them alike); it runs SGD whatever the training optimizer (the
paper fine-tunes with its training SGD, lr 0.1, momentum 0.9); finetune_lr = 0.01 is ours, not tuned.
Against PFLlib (TsingZ0/PFLlib @ d832e76f, `clientbabu.py`, `serverbabu.py`): PFLlib fine-tunes once, after its
last round, each client from the model it then holds (a last-round participant from its own trained body, not the
final average) with the training SGD; featcache's last evaluation at finetune_lr = lr, finetune_momentum = 0 is that
fine-tuning from the final average.
Global model: the averaged body with the initial head, without fine-tuning (the paper's "initial" accuracy).
"""

from __future__ import annotations

import torch
from torch.func import grad

from ..training.config import Setting
from ..training.schedule import hash_keys, trained_counts
from .registry import register
from .base import FedAvg

TUNED = ("full", "head")


def finetune_order(seeds: torch.Tensor, rnd: int, first: int, epochs: int, counts: torch.Tensor, N: int):
    """Each client's rows in fine-tuning order for epochs first … first + epochs − 1 of round `rnd`: [H, C, E, N]
    (seeds [H], counts [C]), padding rows last. One key stream of (seed, round, epoch, row) for every client, so a
    client alone (a Flower client, which does not know its index among the C) draws the permutation it draws here."""
    valid = torch.arange(N, device=counts.device) < counts[:, None]  # [C, N]
    keys = [hash_keys(seeds, rnd, first + e, shape=(1, N)) >> 1 for e in range(epochs)]  # E x [H, 1, N]
    keys = [torch.where(valid, k, torch.iinfo(torch.int64).max) for k in keys]  # E x [H, C, N]
    if not keys:
        return counts.new_zeros(len(seeds), len(counts), 0, N)  # [H, C, 0, N]
    return torch.argsort(torch.stack(keys, 2), dim=-1, stable=True)  # [H, C, E, N]


@register
class FedBABU(FedAvg):
    name = "fedbabu"
    paper = "Oh, Kim and Yun, FedBABU: Toward Enhanced Representation for Federated Image Classification, ICLR 2022"
    uploads = "projection parameters (the body; the head stays at its initialisation)"
    clients_hold_global = False  # clients predict after fine-tuning; the global model is the un-tuned one
    settings = {
        "finetune_epochs": Setting(5, "τ_f, fine-tuning epochs before each evaluation (the paper: 5)", lo=0),
        "finetune_lr": Setting(0.01, "SGD step size of the fine-tuning", lo=0),
        "finetune_momentum": Setting(0.9, "SGD momentum of the fine-tuning (the paper: 0.9)", lo=0, hi=1, hi_open=True),
        "finetune": Setting("full", "full: fine-tune body and head; head: the head alone", choices=TUNED),
    }

    def shared(self, name):
        return name.startswith("proj")  # the body; the head never changes, so it is never sent

    def trainable(self, name, rnd):
        return self.shared(name)

    def context(self, state, rnd):
        data, E, N = rnd.data, self.cfg["finetune_epochs"], rnd.data.features.shape[1]
        per_model = lambda t: t[None].expand(rnd.H, *t.shape)  # [C, ...] -> [H, C, ...] (a view)
        order = finetune_order(rnd.seeds.to(rnd.device), rnd.round, self.local_epochs(), E, data.counts, N)
        rows = trained_counts(data.counts, self.cfg["batch_size"], self.cfg["drop_last"])  # [C]
        local = {"train_x": data.features, "train_y": data.labels, "train_rows": rows}
        return super().context(state, rnd) | {k: per_model(v) for k, v in local.items()} | {"finetune_order": order}

    def fine_tune(self, params, buffers, ctx):
        """τ_f epochs of SGD with momentum on one client's training rows from (params, buffers): the fine-tuned
        (params, buffers). A step with no row of the client changes nothing."""
        x, y, order = ctx["train_x"], ctx["train_y"], ctx["finetune_order"]  # [N, D], [N], [E, N]
        n = ctx["train_rows"]  # [] the rows an epoch trains on (drop_last)
        lr, beta, B = ctx["hp"]["finetune_lr"], ctx["hp"]["finetune_momentum"], self.cfg["batch_size"]
        tuned = {k: v for k, v in params.items() if self.cfg["finetune"] == "full" or not self.shared(k)}
        fixed = {k: v for k, v in params.items() if k not in tuned}
        loss = lambda p, stats, xb, yb, mask: FedAvg.local_loss(self, p | fixed, stats, xb, yb, mask, ctx)
        velocity = {k: torch.zeros_like(v) for k, v in tuned.items()}
        for e in range(order.shape[0]):
            for s in range(0, x.shape[0], B):
                rows = order[e, s : s + B]  # [b]
                mask = s + torch.arange(rows.shape[0], device=x.device) < n  # [b]
                g, new = grad(loss, has_aux=True)(tuned, buffers, x[rows], y[rows], mask)
                step = mask.any()
                velocity = {k: torch.where(step, beta * v + g[k], v) for k, v in velocity.items()}
                tuned = {k: torch.where(step, p - lr * velocity[k], p) for k, p in tuned.items()}
                buffers = buffers | {k: torch.where(step, v, buffers[k]) for k, v in new.items()}
        return tuned | fixed, buffers

    def predict(self, params, buffers, x, ctx):
        return super().predict(*self.fine_tune(params, buffers, ctx), x, ctx)

    def global_model(self, state, rnd):
        """The averaged body with the initial head, which every client holds after the download."""
        return {k: v[:, 0] for k, v in state.params.items()}, {k: v[:, 0] for k, v in state.buffers.items()}

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # no fine-tuning

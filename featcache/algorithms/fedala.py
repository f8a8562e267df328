"""FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated Learning", AAAI 2023,
Alg. 1).

A client does not overwrite its local model Θ_i with the downloaded global model Θ: it starts its next local
training from an element-wise aggregation of the two (Adaptive Local Aggregation, ALA),

    Θ̂_i = Θ_i + (Θ − Θ_i) ⊙ W_i,   W_i = [1, ..., 1 (the lower layers), W_i^p (the top p layers)],

so the lower layers take the global model and the top p layers a learned share of its update. W_i^p ∈ [0, 1] is
learned on s % of the client's training data with Θ, Θ_i fixed, one step per minibatch:

    W_i^p ← clip(W_i^p − η (∇_{Θ̂_i^p} L(Θ̂_i; minibatch)) ⊙ (Θ^p − Θ_i^p), 0, 1),   Θ̂_i^p recomputed from W_i^p.

W_i^p starts at ones and is kept from round to round: in the start phase (a client's first ALA) it is trained until
it converges, after that for one epoch per ALA. Local training and the server are FedAvg's (the participants train
from Θ̂_i and upload it; the server averages by n_k). Differences from FedAvg: `download` runs ALA for every client
(vectorized over [H, C], one Python step per minibatch of the sampled rows); the clients predict with Θ̂_i.
Choices, from the released code (TsingZ0/PFLlib @ d832e76f system/utils/ALA.py, clientala.py, serverala.py; the
authors' TsingZ0/FedALA @ a7a9b213 has the same ALA.py) where the paper leaves them open:
- every client runs ALA at every download (the release's send_models; Alg. 1: the round's selected clients, the same
  at the paper's full participation), so a client that sat rounds out aggregates its own last Θ̂_i again each round;
- s % of the data: the int(s/100 · n_i) rows from a random offset of the client's rows (as cached), drawn per seed,
  round and client (`sampled_rows`), in minibatches of batch_size, the last one short;
- converged: more than num_pre_loss epochs and the standard deviation of the last num_pre_loss epochs' losses on
  their last minibatch below threshold (0.1, the code's; the authors' README says 0.01 for the paper's runs), capped
  at max_start_epochs (the release has no cap; its README warns a small threshold can loop for ever);
- a client whose first parameter tensor sums to the global one's skips ALA (the release's test for the first round,
  where Θ_i = Θ): its model and its start phase wait for the next download;
- p counts the head's layers (projection, classifier): p = 1, the classifier, is PFLlib's layer_idx = 2 (its weight
  and bias); s = 80, η = 1 (PFLlib's and the authors' defaults);
- ALA's forward passes run BN with its running statistics (the downloaded ones) and change none; the BN statistics
  are averaged by the server and downloaded (FedAvg's): ALA aggregates parameters only (the release leaves each client
  its own statistics).
Global model: the server's average Θ (what the clients download before ALA).
Cost: ALA runs for every client at every download, s % of a local epoch over all C clients (num_pre_loss + 1
epochs or more in the start phase), in one pass over [H, C] models (not sliced like local training's `at_once`).
"""

from __future__ import annotations

import torch
from torch.func import vmap

from ..training.config import Setting
from ..training.schedule import hash_keys
from .base import FedAvg, bcast, masked_ce, remember_global
from .registry import register

SLICE_DRAW = 1 << 21  # the hash stream of the sampled rows' offsets (schedule.participation's is 1 << 20)


def sampled_rows(seeds: torch.Tensor, rnd: int, counts: list[int], percent: int) -> tuple[torch.Tensor, list[int]]:
    """ALA's sampled rows at the download of round `rnd`: per model the offset [H, C] (host int64) of each client's
    slice of its rows, and per client its length int(percent/100 · n_i) (ALA.py's rand_num; the offset is uniform
    over 0 … n_i − rand_num, as its random.randint)."""
    sizes = [int(percent / 100 * n) for n in counts]
    span = torch.tensor([n - m + 1 for n, m in zip(counts, sizes)])  # [C]
    keys = hash_keys(seeds.cpu(), rnd, SLICE_DRAW, shape=(len(counts),))  # [H, C]
    return keys % span, sizes


def top_layers(names, p: int) -> list[str]:
    """The parameters of the top p layers (a layer: the names' first dotted part, "proj0", "cls0"), in order."""
    layers = list(dict.fromkeys(k.split(".")[0] for k in names))
    top = set(layers[-p:])
    return [k for k in names if k.split(".")[0] in top]


@register
class FedALA(FedAvg):
    name = "fedala"
    across_clients = (
        "download samples each client's rows at an offset hashed from its index among all C clients, which a client "
        "alone (one of one) does not see"
    )
    paper = "Zhang et al., FedALA: Adaptive Local Aggregation for Personalized Federated Learning, AAAI 2023, Alg. 1"
    uploads = "all head parameters (the trained Θ_i)"
    settings = {
        "eta": Setting(1.0, "η, the learning rate of the aggregation weights W_i^p", lo=0),
        "rand_percent": Setting(80, "s, the percent of a client's training rows ALA learns on", lo=1, hi=100),
        "layers": Setting(1, "p, the top layers ALA weighs (1: the classifier; 2: the whole head)", lo=1),
        "threshold": Setting(0.1, "the start phase stops when the std of its last losses falls below this", lo=0),
        "num_pre_loss": Setting(10, "the start phase's losses whose std is compared with threshold", lo=1),
        "max_start_epochs": Setting(1000, "the most epochs of the start phase", lo=1),
    }
    fedavg_server = False  # download aggregates adaptively, per client
    clients_hold_global = False  # every client predicts with its own Θ̂_i
    personal_predict = False  # a client's Θ̂_i changes at every download, whether it trained or not

    def init_state(self, state, rnd):
        remember_global(state, buffers=True)
        top = top_layers(list(state.params), self.cfg["layers"])
        ones = lambda v: torch.ones((), device=v.device).expand(v.shape)  # [H, C, ...] a broadcast view
        state.client["ala_weights"] = {k: ones(state.params[k]) for k in top}  # W_i^p
        state.client["ala_started"] = torch.zeros(rnd.H, rnd.C, dtype=torch.bool, device=rnd.device)  # [H, C]

    # -- server -----------------------------------------------------------------------------------------------
    def download(self, state, server, rnd):
        """Every client's Θ̂_i from its Θ_i and the server's Θ (ALA); BN statistics as the server averaged them."""
        state.buffers = state.buffers | {k: rnd.expand(v) for k, v in server.items() if k not in state.params}
        glob = {k: v for k, v in server.items() if k in state.params}  # Θ [H, ...]
        state.server["global"] = glob
        state.server["global_buffers"] = {k: v for k, v in server.items() if k not in state.params}
        state.params = self.adaptive_local_aggregation(state, glob, rnd)

    def adaptive_local_aggregation(self, state, glob: dict, rnd) -> dict:
        """Θ̂_i [H, C, ...] of every client (ALA.adaptive_local_aggregation, vectorized); W_i^p and the start-phase
        flags in state.client are updated."""
        local = state.params  # Θ_i [H, C, ...]
        G = {k: rnd.expand(v) for k, v in glob.items()}  # Θ [H, C, ...]
        names = list(local)
        top = top_layers(names, self.cfg["layers"])
        first = names[0]
        skip = (G[first] - local[first]).flatten(2).sum(-1) == 0  # [H, C] Θ_i = Θ: no ALA
        weights, started = state.client["ala_weights"], state.client["ala_started"]
        delta = {k: G[k] - local[k] for k in top}  # Θ^p − Θ_i^p [H, C, ...]
        mix = lambda W: {k: local[k] + delta[k] * W[k] for k in top}  # Θ̂_i^p [H, C, ...]
        theta = mix(weights)

        data, B = rnd.data, self.cfg["batch_size"]
        counts = data.counts.tolist()
        offset, sizes = sampled_rows(rnd.seeds, rnd.round, counts, self.cfg["rand_percent"])
        offset = offset.to(rnd.device)  # [H, C]
        size = torch.tensor(sizes, device=rnd.device)  # [C]
        eta, threshold = rnd.hp["eta"], rnd.hp["threshold"]  # [H]
        lower = {k: G[k] for k in names if k not in top}  # [H, C, ...] the lower layers take Θ
        buffers = state.buffers

        def loss(theta_p, lower_p, buffers_p, x, y, mask):
            params = lower_p | theta_p
            z, _ = self.embed(params, buffers_p, x)  # BN with its running statistics
            return masked_ce(self.logits(params, z), y, mask)

        losses_of = vmap(vmap(loss))  # [H, C]: each model's loss reads its own Θ̂_i^p only

        def step(theta, x, y, mask):
            """∇_{Θ̂_i^p} L(Θ̂_i) name -> [H, C, ...] and L [H, C] of every model on its minibatch."""
            leaves = {k: v.detach().requires_grad_(True) for k, v in theta.items()}
            with torch.enable_grad():
                value = losses_of(leaves, lower, buffers, x, y, mask)  # [H, C]
            return dict(zip(leaves, torch.autograd.grad(value.sum(), list(leaves.values())))), value.detach()

        N, C = data.features.shape[1], rnd.C
        client = torch.arange(C, device=rnd.device)[None, :, None]  # [1, C, 1]
        running = ~skip & (size > 0)  # [H, C] the models still learning W_i^p
        last = torch.zeros(rnd.H, C, device=rnd.device)  # [H, C] each epoch's loss on its last minibatch
        losses: list[torch.Tensor] = []
        n_pre = self.cfg["num_pre_loss"]
        for _epoch in range(self.cfg["max_start_epochs"]):
            if not bool(running.any()):
                break
            for s in range(0, max(sizes), B):
                at = s + torch.arange(B, device=rnd.device)  # [B] positions in the slice
                valid = at[None] < size[:, None]  # [C, B]
                active = running & valid[:, 0]  # [H, C] models with a minibatch at s
                rows = (offset[..., None] + at).clamp(max=N - 1)  # [H, C, B]
                x, y = data.features[client, rows], data.labels[client, rows]  # [H, C, B, D], [H, C, B]
                mask = valid.expand(rnd.H, C, B)  # [H, C, B]
                g, value = step(theta, x, y, mask)  # name -> [H, C, ...], [H, C]
                for k in top:
                    new = (weights[k] - bcast(eta, g[k]) * (g[k] * delta[k])).clamp(0.0, 1.0)
                    weights[k] = torch.where(bcast(active, new), new, weights[k])
                theta = mix(weights)
                last = torch.where(active, value, last)
            losses.append(last)
            running &= ~started  # after its start phase a client trains W_i^p one epoch per ALA
            if len(losses) > n_pre:
                spread = torch.stack(losses[-n_pre:]).double().std(0, correction=0)  # [H, C]
                running &= ~(spread < threshold[:, None])
        state.client["ala_started"] = started | ~skip
        out = {}
        for k in names:
            new = theta[k] if k in top else lower[k]
            out[k] = torch.where(bcast(skip, new), local[k], new)  # [H, C, ...]
        return out

    # -- the global model -------------------------------------------------------------------------------------
    def global_model(self, state, rnd):
        """The server's average Θ, before ALA."""
        return dict(state.server["global"]), dict(state.server["global_buffers"])

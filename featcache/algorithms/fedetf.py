"""FedETF (Li et al., "No Fear of Classifier Biases: Neural Collapse Inspired Federated Learning with Synthetic and
Fixed Classifier", ICCV 2023, §4).

The model on cached features: the projection u = FC(D, proj_dim) + ReLU [+ BN] (the feature extractor), FedETF's
projection layer g = FC(proj_dim, etf_dim) with its ℓ2 normalisation ĥ = g(u(x)) / ||g(u(x))||, and the synthetic,
fixed classifier, a simplex equiangular tight frame
    M = √(K/(K−1)) · U (I_K − 1/K · 1 1^T)   [etf_dim, K],  U^T U = I_K,
U the Q of a QR factorisation of a uniform random matrix, the same on every client, never trained nor sent. Scores:
s = β · ĥ^T M, β a learnable temperature (a scalar, trained and averaged). Differences from FedAvg:
- training (every round) updates and averages u, g and β with the balanced feature loss of client k,
      ℓ = −log( n_{k,y} e^{s_y} / Σ_c n_{k,c} e^{s_c} ),
  n_{k,c} its training rows of class c; a class it lacks counts 1 (the release's sample_per_class);
- local adaptation (personalization), per client from the model it downloaded:
  1. `finetune_epochs` epochs of the balanced loss on u, g and β (SGD at finetune_lr, finetune_momentum,
     finetune_weight_decay: the release's one more local round with its training SGD);
  2. `finetune_rounds` times: `finetune_phase_epochs` epochs of the plain cross-entropy on M alone (SGD at
     finetune_etf_lr, no momentum or weight decay), then as many on g alone (SGD at finetune_proj_lr,
     finetune_momentum, finetune_weight_decay), each phase with a fresh optimizer; β and u fixed;
  clients predict with the adapted model.
Global model: (u, g, M, β) as averaged, not adapted (the paper's generalization metric).

Followed: ZexiLee/ICCV-2023-FedETF @ 092ace34, client_funct.py (`client_fedetf`, `balanced_softmax_loss`,
`Client_update`, `Client_personalization`), server_funct.py (`fedavg`), models_dict/proto_classifiers.py
(`Proto_Classifier`), models_dict/resnet.py (`linear_proto`, `scaling_train`), args.py and main.py, whose values are
the defaults: etf_dim = K (its ResNets'), β^0 = 1, 20 alternations of 3 epochs, SGD rates 0.1 (M) and 0.05 (g),
momentum 0.9, weight decay 5e-4, and its training rate 0.04 for step 1.
Choices and deviations (one line each):
- the adaptation runs before every evaluation, from that round's model, and is dropped after scoring (the release
  adapts once, after the last round: the last evaluation is that);
- step 1 starts with no momentum; the release goes on with each client's training optimizer, kept over the rounds;
- the release keeps every client's training SGD over the rounds (momentum carries over); featcache's local optimizer
  starts each round afresh, as FedAvg's: the same at momentum 0;
- the server weights by the clients' training rows (the release: by each client's whole split, before its 30 %
  validation cut);
- scores are β-scaled everywhere (the release's accuracy reads the argmax of ĥ^T M: the same for β > 0);
- the adaptation's minibatches are permutations hashed from (seed, round, epoch, row) for epochs after the training's,
  one stream for every client (as fedbabu's), at the run's batch_size and drop_last (the release: a shuffled
  DataLoader); with bn=True the BN statistics follow every adaptation step (the release's train mode);
- the ETF needs etf_dim ≥ K (U has K orthonormal columns).
"""

from __future__ import annotations

import math

import torch
from torch.func import grad

from ..errors import UserError
from ..training.config import Setting
from ..training.schedule import hash_keys, trained_counts
from .base import FedAvg, keep_class_counts, masked_ce
from .heads import bn_init, linear, linear_init, mlp_init
from .registry import register

ETF, BETA = "etf", "beta"  # the fixed classifier M [etf_dim, K] and the temperature β []
PROJ = ("etfproj0.weight", "etfproj0.bias")  # the projection layer g
LAST = torch.iinfo(torch.int64).max  # the key of a padding row: it sorts last


def simplex_etf(d: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """M = √(K/(K−1)) U (I − 1/K 11^T) [d, K], U the Q of a uniform random [d, K] matrix (Proto_Classifier)."""
    if d < K:
        raise UserError(f"fedetf: etf_dim={d} is below the {K} classes: the ETF needs K orthonormal columns")
    U, _ = torch.linalg.qr(torch.rand(d, K, generator=gen, dtype=torch.float64))  # [d, K]
    centre = torch.eye(K, dtype=torch.float64) - 1 / K  # I − 1/K 11^T
    return (math.sqrt(K / (K - 1)) * U @ centre).float()


def balanced_ce(scores: torch.Tensor, y: torch.Tensor, log_counts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of −log(n_y e^{s_y} / Σ_c n_c e^{s_c}), scores [N, K], log_counts = log n [K]."""
    return masked_ce(scores + log_counts, y, mask)


def adaptation_keys(seeds: torch.Tensor, rnd: int, first: int, epochs: int, N: int) -> torch.Tensor:
    """The sort keys of the adaptation's epochs first … first + epochs − 1 of round `rnd`: [H, epochs, N], one stream
    of (seed, round, epoch, row) for every client (a client alone draws the same)."""
    keys = [hash_keys(seeds, rnd, first + e, shape=(N,)) >> 1 for e in range(epochs)]  # epochs x [H, N]
    return torch.stack(keys, 1) if keys else torch.zeros(len(seeds), 0, N, dtype=torch.long, device=seeds.device)


@register
class FedETF(FedAvg):
    name = "fedetf"
    paper = (
        "Li et al., No Fear of Classifier Biases: Neural Collapse Inspired Federated Learning with Synthetic and Fixed "
        "Classifier, ICCV 2023"
    )
    uploads = "projection, ETF projection layer and temperature β (the fixed ETF classifier is never sent)"
    clients_hold_global = False  # clients predict with their adapted models; the global model is not adapted
    settings = {
        "etf_dim": Setting(0, "width of the ETF projection layer and of the ETF (0: K, the release's ResNets)", lo=0),
        "beta0": Setting(1.0, "β's initial value (the release's ResNets: 1)", lo=0, lo_open=True, batched=False),
        "finetune_epochs": Setting(
            3, "adaptation step 1: epochs of the balanced loss on u, g, β (the release: its E)", lo=0
        ),
        "finetune_lr": Setting(0.04, "SGD rate of adaptation step 1 (the release's training rate)", lo=0),
        "finetune_momentum": Setting(0.9, "SGD momentum of step 1 and of g's phases", lo=0, hi=1, hi_open=True),
        "finetune_weight_decay": Setting(5e-4, "SGD weight decay of step 1 and of g's phases", lo=0),
        "finetune_rounds": Setting(20, "adaptation step 2: alternations of M's and g's phases (the release: 20)", lo=0),
        "finetune_phase_epochs": Setting(3, "epochs of each phase of an alternation (the release: 3)", lo=1),
        "finetune_etf_lr": Setting(0.1, "SGD rate of M's phases (the release: 0.1)", lo=0),
        "finetune_proj_lr": Setting(0.05, "SGD rate of g's phases (the release: 0.05)", lo=0),
    }

    # -- model ------------------------------------------------------------------------------------------------
    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = mlp_init([d_in, cfg["proj_dim"]], gen, prefix="proj")  # u
        if cfg["bn"]:
            bn_init(params, buffers, "proj0.bn", cfg["proj_dim"])
        d = cfg["etf_dim"] or num_classes
        linear_init(params, "etfproj0", cfg["proj_dim"], d, gen)  # g [d, proj_dim]
        params[ETF] = simplex_etf(d, num_classes, gen)  # M [d, K]
        params[BETA] = torch.tensor(float(cfg["beta0"]))  # β []
        return params, buffers

    def logits(self, params, z):
        h = linear(params, "etfproj0", z)  # [N, d]
        h = h / h.norm(dim=-1, keepdim=True).clamp(min=1e-12)  # ĥ
        return params[BETA] * (h @ params[ETF])  # [N, K]

    def shared(self, name):
        return name != ETF  # the ETF is the same everywhere and never changes

    def trainable(self, name, rnd):
        return name != ETF

    # -- client -----------------------------------------------------------------------------------------------
    def init_state(self, state, rnd):
        keep_class_counts(state, rnd)

    def context(self, state, rnd):
        data, N = rnd.data, rnd.data.features.shape[1]
        per_model = lambda t: t[None].expand(rnd.H, *t.shape)  # [C, ...] -> [H, C, ...] (a view)
        local = {
            "train_x": data.features,  # [C, N, D]
            "train_y": data.labels,  # [C, N]
            "train_count": data.counts,  # [C] the client's rows
            "train_rows": trained_counts(data.counts, self.cfg["batch_size"], self.cfg["drop_last"]),  # [C] per epoch
        }
        epochs = self.cfg["finetune_epochs"] + 2 * self.cfg["finetune_rounds"] * self.cfg["finetune_phase_epochs"]
        keys = adaptation_keys(rnd.seeds.to(rnd.device), rnd.round, self.local_epochs(), epochs, N)  # [H, E, N]
        return (
            super().context(state, rnd)
            | {k: per_model(v) for k, v in local.items()}
            | {
                "log_counts": state.client["class_counts"].clamp(min=1).log(),  # [H, C, K] log n_{k,c}
                "adaptation_keys": keys[:, None].expand(rnd.H, rnd.C, *keys.shape[1:]),  # [H, C, E, N] a view
            }
        )

    def local_loss(self, params, buffers, x, y, mask, ctx):
        return self.balanced_loss(params, buffers, x, y, mask, ctx)

    def balanced_loss(self, params, buffers, x, y, mask, ctx):
        """The balanced feature loss of a minibatch: training's, and the adaptation's step 1."""
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return balanced_ce(self.logits(params, z), y, ctx["log_counts"], mask), new_buffers

    def plain_loss(self, params, buffers, x, y, mask, ctx):
        """The adaptation's step-2 loss: the cross-entropy of the β-scaled scores."""
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return masked_ce(self.logits(params, z), y, mask), new_buffers

    def sgd(self, loss, params, buffers, ctx, names, epochs: range, lr, momentum, weight_decay):
        """torch.optim.SGD (dampening 0) on the tensors `names` of one client's model for the adaptation epochs
        `epochs` of `loss` over its training rows: the new (params, buffers). A step with no row changes nothing."""
        x, y, keys = ctx["train_x"], ctx["train_y"], ctx["adaptation_keys"]  # [N, D], [N], [E, N]
        N, B = x.shape[0], self.cfg["batch_size"]
        starts = range(0, N, B)  # each epoch's minibatches
        if x.device.type == "meta":  # the memory estimate's shape-only replay: one step allocates what each one does
            epochs, starts = epochs[:1], starts[:1]
        valid = torch.arange(N, device=x.device) < ctx["train_count"]  # [N] the client's rows
        tuned = {k: params[k] for k in names}
        fixed = {k: v for k, v in params.items() if k not in names}
        step_loss = lambda p, stats, xb, yb, m: loss(p | fixed, stats, xb, yb, m, ctx)
        velocity = {k: torch.zeros_like(v) for k, v in tuned.items()}
        for e in epochs:
            order = torch.argsort(torch.where(valid, keys[e], LAST), stable=True)  # [N]
            for s in starts:
                rows = order[s : s + B]  # [b]
                mask = s + torch.arange(rows.shape[0], device=x.device) < ctx["train_rows"]  # [b]
                g, new = grad(step_loss, has_aux=True)(tuned, buffers, x[rows], y[rows], mask)
                step = mask.any()
                d = {k: g[k] + weight_decay * tuned[k] for k in tuned}
                velocity = {k: torch.where(step, momentum * v + d[k], v) for k, v in velocity.items()}
                tuned = {k: torch.where(step, p - lr * velocity[k], p) for k, p in tuned.items()}
                buffers = buffers | {k: torch.where(step, v, buffers[k]) for k, v in new.items()}
        return tuned | fixed, buffers

    def adapt(self, params, buffers, ctx):
        """The local adaptation of one client's model (steps 1 and 2): the adapted (params, buffers)."""
        hp, E1, F = ctx["hp"], self.cfg["finetune_epochs"], self.cfg["finetune_phase_epochs"]
        every = [k for k in params if k != ETF]
        momentum, decay = hp["finetune_momentum"], hp["finetune_weight_decay"]
        params, buffers = self.sgd(
            self.balanced_loss, params, buffers, ctx, every, range(E1), hp["finetune_lr"], momentum, decay
        )
        for r in range(self.cfg["finetune_rounds"]):
            first = E1 + 2 * r * F
            params, buffers = self.sgd(
                self.plain_loss, params, buffers, ctx, [ETF], range(first, first + F), hp["finetune_etf_lr"], 0.0, 0.0
            )
            params, buffers = self.sgd(
                self.plain_loss, params, buffers, ctx, PROJ, range(first + F, first + 2 * F),
                hp["finetune_proj_lr"], momentum, decay,
            )  # fmt: skip
        return params, buffers

    def predict(self, params, buffers, x, ctx):
        return super().predict(*self.adapt(params, buffers, ctx), x, ctx)

    # -- the global model -------------------------------------------------------------------------------------
    def global_model(self, state, rnd):
        """(u, g, M, β) as every client holds them after the download (M is every client's own copy of the same)."""
        return {k: v[:, 0] for k, v in state.params.items()}, {k: v[:, 0] for k, v in state.buffers.items()}

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # not adapted

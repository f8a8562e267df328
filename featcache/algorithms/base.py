"""FedAvg (McMahan et al., 2017) and the hooks every other algorithm overrides.

The model on top of the frozen backbones is the FedPCL baselines' head (fedpcl.md §5.1): a projection layer
FC(D, proj_dim) + ReLU (+ BN with bn=True) followed by a classifier FC(proj_dim, K).

Hooks, in the order the engine calls them each round:
    context(state, engine)           per-model tensors the local loss and inference need, leading [H, C]
    local_loss(params, buffers, x, y, mask, ctx) -> (loss, new_buffers)   ONE client's minibatch loss (vmapped)
        local_epochs(), trainable(name, epoch), lr_scale(name)   what is trained when, and how fast
    after_local(state, engine)       e.g. compute prototypes on the client's data
    upload(state, engine)            what each client sends: name -> [H, C, ...]
    aggregate(uploads, weights, state, engine) -> server state, name -> [H, ...]
    download(state, server, part, engine)    what clients take from the server
    predict(params, buffers, x, ctx) -> scores [N, K]       ONE client's inference (vmapped)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine import expand_hc
from ..heads import linear, mlp, mlp_init
from . import register


def masked_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of v [B] over rows where mask [B] is True (0 when there are none)."""
    m = mask.float()
    return (v * m).sum() / m.sum().clamp(min=1)


def one_hot(y: torch.Tensor, K: int) -> torch.Tensor:
    """[N] -> [N, K] bool (vmap-safe, unlike F.one_hot); padding labels (-1) give all-False rows."""
    return y[..., None] == torch.arange(K, device=y.device)


def logsumexp(s: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """torch.logsumexp with exponents clamped at −87 (e^−87 ≈ 1.6e−38: a term that cannot change a float32 sum
    holding e^0 = 1). The CPU's exp is ~30x slower on arguments that underflow, which at τ = 0.07 and on −inf masks
    is most of them. A row that is all −inf gives a finite, very negative value instead of −inf (no NaN downstream)."""
    m = s.detach().amax(dim, keepdim=True)
    m = m.masked_fill(~torch.isfinite(m), 0)
    out = (s - m).clamp(min=-87).exp().sum(dim, keepdim=True).log() + m
    return out if keepdim else out.squeeze(dim)


def masked_ce(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(F.cross_entropy(logits, y.clamp(min=0), reduction="none"), mask)


def weighted_mean(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Average [H, C, ...] over clients with weights [H, C] -> [H, ...] (FedAvg's n_k / n)."""
    w = w / w.sum(1, keepdim=True).clamp(min=1e-12)  # [H, C]
    return torch.einsum("hc,hc...->h...", w.to(v.dtype), v)  # a batched product: no [H, C, ...] temporary


@register
class FedAvg:
    name = "fedavg"
    paper = "McMahan et al., AISTATS 2017 (fedpcl.md Table 2 baseline)"
    uploads = "all head parameters"
    defaults: dict = {"proj_dim": 256, "bn": False}
    structural: tuple = ()  # float hyperparameters that cannot vary inside one batched run

    # -- model ------------------------------------------------------------------------------------------------
    def init(self, cfg: dict, d_in: int, num_classes: int, gen: torch.Generator):
        params, buffers = mlp_init([d_in, cfg["proj_dim"]], gen, prefix="proj", bn=False)
        if cfg["bn"]:
            from ..heads import bn_init

            bn_init(params, buffers, "proj0.bn", cfg["proj_dim"])
        head, _ = mlp_init([cfg["proj_dim"], num_classes], gen, prefix="cls")
        return params | head, buffers

    def embed(self, params, buffers, x, mask=None, train=False):
        """Projection network output z [N, proj_dim] and updated BN statistics."""
        return mlp(params, buffers, x, 1, prefix="proj", mask=mask, train=train, final_relu=True)

    def logits(self, params, z):
        return linear(params, "cls0", z)  # [N, K]

    # -- client -----------------------------------------------------------------------------------------------
    def context(self, state, engine) -> dict:
        return {"hp": {k: expand_hc(v, engine.C) for k, v in state.hp.items()}}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        return masked_ce(self.logits(params, z), y, mask), new_buffers

    def predict(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        return self.logits(params, z)

    def local_epochs(self) -> int:
        return self.cfg["local_epochs"]

    def trainable(self, name: str, epoch: int) -> bool:
        """Whether parameter `name` is updated in local epoch `epoch` (alternating phases train subsets)."""
        return True

    def lr_scale(self, name: str) -> float:
        """Learning-rate multiplier of parameter `name` (for per-module rates)."""
        return 1.0

    def init_state(self, state, engine) -> None:
        pass

    def after_local(self, state, engine) -> None:
        pass

    # -- server -----------------------------------------------------------------------------------------------
    def shared(self, name: str) -> bool:
        """Which parameters are uploaded and averaged."""
        return True

    def upload(self, state, engine) -> dict:
        """Shared parameters and shared buffers (BN running statistics travel with their layer)."""
        return {k: v for k, v in (state.params | state.buffers).items() if self.shared(k)}

    def aggregate(self, uploads: dict, weights: torch.Tensor, state, engine) -> dict:
        return {k: weighted_mean(v, weights) for k, v in uploads.items()}

    def download(self, state, server: dict, part: torch.Tensor, engine) -> None:
        for k, v in server.items():
            target = state.params if k in state.params else state.buffers
            target[k] = expand_hc(v, engine.C).clone()

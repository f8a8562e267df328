"""FedPFT, FedPFT+Con and FedAvg+Linear (Wu et al., "From Mismatch to Harmony: Resolving Feature-Classifier Mismatch
in Federated Learning via Prompt-Driven Feature Transformation", ICLR 2025 submission, §3, Alg. 1, App. C–F).

No public code exists; every choice below is derived from the paper, and marked where the paper is silent.

Model on cached features. ϕ (the paper's feature extractor) is the learnable layer above the frozen backbone, as in
FedAvg here: FC(D, m) + ReLU with m = proj_dim. h_κ is FC(m, K).

FTM τ (§3.3, eq. 2): one multi-head self-attention layer over the tokens [f, p_1..p_n] (f = ϕ(x), p = prompts, all
in R^m); f' is the output at f's position. Its size follows App. N, Table 15: τ has 0.26M parameters for ResNet-8
(m = 256) and 1.05M for ResNet-10 (m = 512), i.e. 4m² + 4m = the Q, K, V and output projections of
torch.nn.MultiheadAttention and nothing else (an MLP block would add ≥ 2m² more). So: no MLP and no LayerNorm.
The paper shows no formula for the rest; our choices: a residual connection (residual=True), because without it
f' starts as W_o(v_f + Σ v_p)/(1 + n) and SGD at the paper's rates stalls (on separable synthetic data at lr 0.1 it
learns only with the residual); `heads` = 1 (App. H plots one attention row per sample). Initialised as
nn.MultiheadAttention (Xavier-uniform Q/K/V, zero biases). Only the row of f is computed:
f' = f + W_o softmax(q_f [k_f, k_p]ᵀ / √d_h) [v_f, v_p] + b_o, which equals row 0 of full self-attention.
Prompts p_κ (n_κ = 10, App. D.3) are initialised N(0, 0.02²) like timm's learned tokens (the paper is silent).

FedPFT (Alg. 1): each round R = R_f + R_a local epochs (local_epochs must equal r_f + r_a), (R_f, R_a) = (4, 1):
    feature transformation phase, eq. 4 (R_f epochs): train p_κ and τ; ϕ and h_κ frozen;
    model training phase, eq. 5 (R_a epochs):        train ϕ, τ, h_κ; p_κ frozen.
Clients upload ϕ, τ, h_κ (FedAvg-averaged, §3.5); p_κ never leaves the client. Inference: h_κ(τ([ϕ(x), p_κ])).
Optimizer (App. D.3): SGD, lr 0.1, the FTM at 0.05 (ftm_lr_scale 0.5, the FTM group's multiplier). The paper names
no momentum or weight decay: torch.optim.SGD's defaults (0, 0).

FedPFT+Con (§3.6, App. C): a second prompt set p_ρ (n_ρ = n_κ; the paper gives no number) and a projection head h_ρ
add eq. 7's MoCo loss on two augmented views x', x'' (cached views 0 and 1):
q = h_ρ τ([ϕ(x'), p_ρ]), k₊ = h̃_ρ τ([ϕ̃(x''), p_ρ]) — as written, the key uses the current τ and p_ρ and momentum
copies ϕ̃, h̃_ρ; keys carry no gradient; q and keys are L2-normalised; negatives come from a queue; temperature β.
Per phase, each loss trains only the parameters that eq. 8 / eq. 9 list before its semicolon:
    transformation phase, eq. 8:  L_CE trains p_κ, τ;      L_Con trains ϕ, τ, h_ρ   (h_κ, p_ρ frozen)
    model phase, eq. 9:           L_CE trains ϕ, τ, h_κ;   L_Con trains p_ρ, τ      (p_κ, h_ρ frozen)
so ϕ learns only from L_Con in the first phase and only from L_CE in the second: the context carries the phase of the
epoch as a per-model flag ctx["transform"], which routes the gradients with torch.where.
Uploaded: ϕ, τ, h_κ and h_ρ (§3.6 calls h_ρ global). Local: p_κ, p_ρ and the MoCo state, kept per client in buffers
and updated every step in MoCo's order: momentum update θ̃ ← m θ̃ + (1 - m) θ from the current parameters, keys,
then the batch's keys enter the queue (newest first; the oldest fall off). The momentum encoder is never reset: it
tracks the client's downloaded-then-trained model across rounds. Not given by the paper, taken from the MoCo it cites
(He et al. 2020, v1): linear head FC(m, 128), m = 0.999, β = 0.07, queue initialised with random unit vectors; the
queue holds 1024 keys (MoCo's 65,536 is 130x a client's 500 images). FTM lr 0.01 (ftm_lr_scale 0.1): App. D.3 says "the
learning rate for the FTM remains 0.01" for FedPFT+Con, contradicting FedPFT's 0.05; each number is used as written.

FedAvg+Linear (App. F, Table 9): a personalised linear layer T_i (m x m, with bias) between the global ϕ and h, in
place of τ and the prompts. The paper gives no schedule; we use FedPFT's alternating one with T_i in the prompts'
role: R_f epochs train T_i (ϕ, h frozen), R_a epochs train ϕ and h (T_i frozen). T_i starts as the identity, so
round 1 starts from FedAvg's model. ϕ and h are averaged; T_i stays local.

Global model (all three): none. Inference needs the prompts (or T_i), which never leave the clients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import UserError
from .heads import linear, linear_init
from ..training.config import Setting
from ..training.optim import Group
from .base import FedAvg, logsumexp, masked_ce, masked_mean
from .registry import register

Params = dict[str, torch.Tensor]


# -- the feature transformation module τ ---------------------------------------------------------------------------
def ftm_init(params: Params, m: int, gen: torch.Generator) -> None:
    """Q, K, V, O projections m -> m, initialised as torch.nn.MultiheadAttention (4m² + 4m parameters)."""
    bound = math.sqrt(6 / (m + 3 * m))  # Xavier-uniform over the stacked [3m, m] in-projection
    for name in ("q", "k", "v"):
        params[f"ftm.{name}.weight"] = (torch.rand(m, m, generator=gen) * 2 - 1) * bound  # [m, m]
        params[f"ftm.{name}.bias"] = torch.zeros(m)
    linear_init(params, "ftm.o", m, m, gen)
    params["ftm.o.bias"] = torch.zeros(m)


def ftm(params: Params, f: torch.Tensor, prompts: torch.Tensor, heads: int, residual: bool) -> torch.Tensor:
    """Eq. 2: f' = τ([f, p])[0] for every row of f [N, m] with the same prompts [n, m] -> [N, m]
    (plus f itself with residual=True)."""
    N, m = f.shape
    d = m // heads
    split = lambda t: t.reshape(*t.shape[:-1], heads, d)  # [..., m] -> [..., heads, d]
    q, k_f, v_f = (split(linear(params, f"ftm.{s}", f)) for s in "qkv")  # [N, heads, d]
    k_p, v_p = (split(linear(params, f"ftm.{s}", prompts)) for s in "kv")  # [n, heads, d]
    s_self = (q * k_f).sum(-1, keepdim=True)  # [N, heads, 1]  f attends to itself
    s_prompt = torch.einsum("Nhd,nhd->Nhn", q, k_p)  # [N, heads, n]
    a = torch.softmax(torch.cat([s_self, s_prompt], -1) / math.sqrt(d), -1)  # [N, heads, 1 + n]
    out = a[..., :1] * v_f + torch.einsum("Nhn,nhd->Nhd", a[..., 1:], v_p)  # [N, heads, d]
    attended = linear(params, "ftm.o", out.reshape(N, m))  # [N, m]
    return f + attended if residual else attended


# -- MoCo (FedPFT+Con) ----------------------------------------------------------------------------------------------
def info_nce(q: torch.Tensor, k_pos: torch.Tensor, queue: torch.Tensor, beta) -> torch.Tensor:
    """Eq. 7 per sample: -log exp(q·k₊/β) / (exp(q·k₊/β) + Σ_j exp(q·k_j/β)), q, k₊ [N, d], queue [Q, d] -> [N]."""
    pos = (q * k_pos).sum(-1, keepdim=True)  # [N, 1]
    logits = torch.cat([pos, q @ queue.T], -1) / beta  # [N, 1 + Q]
    return logsumexp(logits) - logits[:, 0]


def enqueue(queue: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MoCo's FIFO: the valid keys [B, d] (mask [B]) enter at the front of queue [Q, d], the oldest fall off."""
    n = mask.sum()
    fresh = keys[torch.argsort((~mask).long(), stable=True)]  # [B, d] valid rows first, in batch order
    j = torch.arange(queue.shape[0], device=queue.device)  # [Q]
    take_fresh = (j < n)[:, None]  # [Q, 1]
    old = queue[(j - n).clamp(min=0)]  # [Q, d] the queue shifted back by n
    return torch.where(take_fresh, fresh[j.clamp(max=len(keys) - 1)], old)


# -- the alternating schedule shared by FedPFT and FedAvg+Linear (§3.5, Alg. 1) -----------------------------------
SCHEDULE = {  # the settings of the schedule and its optimizer (App. D.3), in each algorithm's `settings`
    "r_f": Setting(4, "R_f, local epochs of the feature transformation phase (App. D.3)", lo=0),
    "r_a": Setting(1, "R_a, local epochs of the model training phase (App. D.3)", lo=0),
    "local_epochs": 5,  # R = R_f + R_a (§4.1)
    "optimizer": "sgd",
    "lr": 0.1,
    "momentum": 0.0,
    "weight_decay": 0.0,  # SGD lr 0.1 (App. D.3), SGD's 0, 0
}


class Alternating(FedAvg):
    """R_f epochs of the feature transformation phase, then R_a epochs of the model training phase; parameters named
    by `personal` stay on the client, the rest is FedAvg-averaged. A subclass declares SCHEDULE's settings."""

    phases: dict[str, tuple[str, ...]] = {}  # phase -> prefixes of the parameter names it trains
    personal: tuple[str, ...] = ()
    clients_hold_global = False  # the `personal` parameters stay on the client: no complete server model

    def init_state(self, state, rnd):
        r_f, r_a, r = self.cfg["r_f"], self.cfg["r_a"], self.cfg["local_epochs"]
        if min(r_f, r_a) < 0 or r_f + r_a != r:
            raise UserError(
                f"{self.name}: local epochs split into phases, R = R_f + R_a: need r_f, r_a >= 0 and "
                f"local_epochs = r_f + r_a (got r_f={r_f}, r_a={r_a}, local_epochs={r})"
            )

    def phase(self, epoch: int) -> str:
        return "transform" if epoch < self.cfg["r_f"] else "model"

    def trainable(self, name, rnd):
        return name.startswith(self.phases[self.phase(rnd.epoch)])

    def shared(self, name):
        return not name.startswith(self.personal)


# -- FedPFT -----------------------------------------------------------------------------------------------------------
@register
class FedPFT(Alternating):
    name = "fedpft"
    paper = "Wu et al., FedPFT, ICLR 2025 submission, §3 eq. 2–5, Alg. 1, App. D.3"
    uploads = "extractor ϕ, FTM τ and classifier h_κ (prompts p_κ stay local)"
    settings = {  # ϕ = FC(D, m) + ReLU: FedAvg's proj_dim m = 256 is ResNet-8's width in Table 15
        "n_prompts": Setting(10, "n_κ, prompts per client (App. D.3)", lo=1),
        "heads": Setting(1, "attention heads of the FTM (ours; divides proj_dim)", lo=1),
        "residual": Setting(True, "residual connection around the FTM (ours, see the docstring)"),
        **SCHEDULE,
        "ftm_lr_scale": Setting(
            0.5, "the FTM's learning rate as a multiple of lr (App. D.3)", lo=0, batched=False
        ),  # a per-parameter-group rate (`groups`), fixed at construction
    }
    phases = {"transform": ("prompt.kappa", "ftm."), "model": ("proj", "ftm.", "cls")}  # eq. 4, eq. 5
    personal: tuple[str, ...] = ("prompt.",)
    groups = {"": Group(), "ftm.": Group(lr_scale="ftm_lr_scale")}  # the FTM's rate: lr x ftm_lr_scale

    def init(self, cfg, d_in, num_classes, gen):
        m = cfg["proj_dim"]
        if m % cfg["heads"]:
            raise UserError(f"{self.name}: proj_dim={m} must be a multiple of heads={cfg['heads']}")
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        ftm_init(params, m, gen)
        params["prompt.kappa"] = torch.randn(cfg["n_prompts"], m, generator=gen) * 0.02  # [n_κ, m]
        return params, buffers

    def embed(self, params, buffers, x, mask=None, train=False):
        """f' = τ([ϕ(x), p_κ]): the classifier's input [N, m]."""
        f, new = super().embed(params, buffers, x, mask, train)  # [N, m]
        return ftm(params, f, params["prompt.kappa"], self.cfg["heads"], self.cfg["residual"]), new


# -- FedPFT+Con -------------------------------------------------------------------------------------------------------
VIEWS_ERROR = "fedpft-con needs augmented views: extract with --views 2"


@register
class FedPFTCon(FedPFT):
    name = "fedpft-con"
    paper = "Wu et al., FedPFT, ICLR 2025 submission, §3.6, App. C eq. 6–9, App. D.3"
    uploads = "extractor ϕ, FTM τ, classifier h_κ and projection head h_ρ (prompts p_κ, p_ρ stay local)"
    settings = {
        "ftm_lr_scale": 0.1,  # "the learning rate for the FTM remains 0.01" (App. D.3) = 0.1 x 0.1
        "con_dim": Setting(128, "width of the projection head h_ρ (MoCo v1's)", lo=1),
        "queue": Setting(1024, "negative keys in each client's MoCo queue (ours)", lo=1),
        "beta": Setting(0.07, "β, the MoCo temperature (MoCo v1's τ)", lo=0, lo_open=True),
        "moco_m": Setting(0.999, "m, the momentum encoder's update (MoCo v1's)", lo=0, hi=1),
    }
    phases = {
        "transform": ("prompt.kappa", "ftm.", "proj", "rho"),  # eq. 8
        "model": ("proj", "ftm.", "cls", "prompt.rho"),
    }  # eq. 9
    personal = ("prompt.", "ema.", "queue")  # prompts and the client's MoCo state (buffers) stay local
    momentum = ("proj", "rho")  # parameters with a momentum copy (ϕ̃, h̃_ρ) in buffers "ema.<name>"
    uses_views = True  # train.py loads the cached augmented views for this algorithm
    limitation = (
        "the two augmented views are the ones cached at extraction (--views), the same every epoch, "
        "not fresh augmentations per step as in MoCo"
    )

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        m, d = cfg["proj_dim"], cfg["con_dim"]
        params["prompt.rho"] = torch.randn(cfg["n_prompts"], m, generator=gen) * 0.02  # [n_ρ, m]
        linear_init(params, "rho0", m, d, gen)
        buffers |= {f"ema.{k}": v.clone() for k, v in params.items() if k.startswith(self.momentum)}
        buffers["queue"] = F.normalize(torch.randn(cfg["queue"], d, generator=gen), dim=-1)  # [Q, d] as MoCo
        return params, buffers

    def init_state(self, state, rnd):
        super().init_state(state, rnd)
        if rnd.data.views is None or rnd.data.views.shape[2] < 2:
            raise UserError(VIEWS_ERROR)

    def context(self, state, rnd):
        """Adds the epoch's phase as a per-model flag [H, C] (eq. 8 vs eq. 9 route the losses' gradients)."""
        transform = self.phase(rnd.epoch) == "transform"
        flag = torch.full((rnd.H, rnd.C), transform, dtype=torch.bool, device=rnd.device)  # [H, C]
        return super().context(state, rnd) | {"transform": flag}

    def local_loss(self, params, buffers, x, y, mask, ctx):
        heads, res, hp = self.cfg["heads"], self.cfg["residual"], ctx["hp"]
        transform = ctx["transform"]  # this epoch's phase (a 0-d bool per model)
        f, new_buffers = FedAvg.embed(self, params, buffers, x, mask, train=True)  # ϕ(x) [B, m]
        f_ce = torch.where(transform, f.detach(), f)  # eq. 8: L_CE does not train ϕ in the transformation phase
        ce = masked_ce(self.logits(params, ftm(params, f_ce, params["prompt.kappa"], heads, res)), y, mask)

        views = ctx["views"]  # [B, V, D]
        f_q, _ = FedAvg.embed(self, params, buffers, views[:, 0], mask, train=True)  # ϕ(x') [B, m]
        f_q = torch.where(transform, f_q, f_q.detach())  # eq. 9: L_Con does not train ϕ in the model phase
        q = F.normalize(linear(params, "rho0", ftm(params, f_q, params["prompt.rho"], heads, res)), dim=-1)  # [B, d]
        ema = {
            k[4:]: hp["moco_m"] * v + (1 - hp["moco_m"]) * params[k[4:]].detach()
            for k, v in buffers.items()
            if k.startswith("ema.")
        }  # ϕ̃, h̃_ρ after the momentum update
        f_k, _ = FedAvg.embed(self, ema, buffers, views[:, 1], mask, train=True)  # ϕ̃(x'') [B, m]
        k = F.normalize(linear(ema, "rho0", ftm(params, f_k, params["prompt.rho"], heads, res)), dim=-1).detach()
        con = masked_mean(info_nce(q, k, buffers["queue"], hp["beta"]), mask)

        new_buffers |= {f"ema.{n}": v.detach() for n, v in ema.items()}
        new_buffers["queue"] = enqueue(buffers["queue"], k, mask)
        return ce + con, new_buffers


# -- FedAvg+Linear ----------------------------------------------------------------------------------------------------
@register
class FedAvgLinear(Alternating):
    name = "fedavg-linear"
    paper = "Wu et al., FedPFT, ICLR 2025 submission, App. F, Table 9"
    uploads = "extractor ϕ and classifier h (the linear transform T_i stays local)"
    settings = SCHEDULE
    phases = {"transform": ("lin.",), "model": ("proj", "cls")}
    personal = ("lin.",)

    def init(self, cfg, d_in, num_classes, gen):
        params, buffers = super().init(cfg, d_in, num_classes, gen)
        m = cfg["proj_dim"]
        params["lin.weight"], params["lin.bias"] = torch.eye(m), torch.zeros(m)  # T_i = identity at the start
        return params, buffers

    def embed(self, params, buffers, x, mask=None, train=False):
        f, new = super().embed(params, buffers, x, mask, train)  # ϕ(x) [N, m]
        return linear(params, "lin", f), new

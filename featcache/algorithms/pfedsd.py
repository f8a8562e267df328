"""pFedSD (Jin et al., "Personalized Edge Intelligence via Federated Self-Knowledge Distillation", IEEE TPDS 2022):
personalized self-knowledge distillation.

Differences from FedAvg:
- every client keeps its personalized model, the model it holds after its last local training (θ̂_i);
- local loss: a client starts from the global model and trains on
  CE(y, f(x; θ)) + λ·T²·KL(softmax(f(x; θ̂_i)/T) ‖ softmax(f(x; θ)/T)),
  the teacher θ̂_i being its personalized model of the previous round it took part in (detached); with bn=True the
  teacher normalises with the minibatch's statistics, as the released teacher, a copy of the trained model left in
  train mode (the paper is silent); before a client has trained once there is no teacher and the loss is the
  cross-entropy alone;
- each client is evaluated with its personalized model θ̂_i (held in state.client["personal"], parameters and BN
  running statistics), not with the global model it downloads.
The server is FedAvg: the n_k / n mean of the participants, BN statistics included. Partial participation is our
choice between the two released codes, which disagree: FLAIR-Community/Fling (fling/component/group/base_group.py)
averages every client, size-weighted; CGCL-codes/pFedSD (pcode/masters/master_pFedSD.py) the selected ones,
unweighted. Global model: FedAvg's averaged model (the one clients start from), predicting by itself.
Defaults λ = 0.5, T = 3 are Fling's (flzoo/cifar10/cifar10_pfedsd_resnet_config.py; the same in its CIFAR-100 and
Tiny-ImageNet configs); CGCL-codes/pFedSD's README runs leave parameters.py's λ = 1 (--lamda), T = 1 (--KL_T), and
its server averages parameters only: neither is followed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..training.config import Setting
from .registry import register
from .base import FedAvg, bcast, masked_ce, masked_mean


def self_distillation(student: torch.Tensor, teacher: torch.Tensor, T) -> torch.Tensor:
    """Per row T²·KL(softmax(teacher/T) ‖ softmax(student/T)): [N]."""
    p = F.log_softmax(teacher / T, -1)
    q = F.log_softmax(student / T, -1)
    return T * T * (p.exp() * (p - q)).sum(-1)


@register
class PFedSD(FedAvg):
    name = "pfedsd"
    paper = "Jin et al., Personalized Edge Intelligence via Federated Self-Knowledge Distillation, IEEE TPDS 2022"
    uploads = "all head parameters"
    personal_predict = True  # θ̂_i, refreshed for the round's participants only
    fedavg_server = False  # θ̂_i, the teacher, is taken after local training (after_local)
    clients_hold_global = False  # the clients predict with their personalized models
    settings = {  # Fling's configs (see the module docstring)
        "temperature": Setting(3.0, "T, the distillation temperature (Fling: 3; CGCL-codes: 1)", lo=0, lo_open=True),
        "lam": Setting(0.5, "λ, weight of the self-distillation term (Fling: 0.5; CGCL-codes: 1)", lo=0),
    }

    def init_state(self, state, rnd):
        state.client["personal"] = {k: v.clone() for k, v in (state.params | state.buffers).items()}
        state.client["has_teacher"] = torch.zeros(rnd.H, rnd.C, device=rnd.device)  # [H, C] 1 once trained

    def context(self, state, rnd):
        return super().context(state, rnd) | {
            "personal": state.client["personal"],
            "has_teacher": state.client["has_teacher"],
        }

    def local_loss(self, params, buffers, x, y, mask, ctx):
        z, new_buffers = self.embed(params, buffers, x, mask, train=True)
        logits = self.logits(params, z)
        with torch.no_grad():  # the teacher normalises with the minibatch's statistics (train mode)
            zt, _ = self.embed(ctx["personal"], ctx["personal"], x, mask, train=True)
            teacher = self.logits(ctx["personal"], zt)
        kd = self_distillation(logits, teacher, ctx["hp"]["temperature"])  # [B]
        reg = ctx["hp"]["lam"] * ctx["has_teacher"] * masked_mean(kd, mask)
        return masked_ce(logits, y, mask) + reg, new_buffers

    def predict(self, params, buffers, x, ctx):
        return super().predict(ctx["personal"], ctx["personal"], x, ctx)

    def predict_global(self, params, buffers, x, ctx):
        return FedAvg.predict(self, params, buffers, x, ctx)  # the averaged model, not θ̂_i

    def after_local(self, state, rnd):
        for k, v in (state.params | state.buffers).items():  # participants' trained models become θ̂_i
            state.client["personal"][k] = torch.where(bcast(rnd.part, v), v, state.client["personal"][k])
        state.client["has_teacher"] = torch.maximum(state.client["has_teacher"], rnd.part.float())

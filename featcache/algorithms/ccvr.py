"""CCVR (Luo et al., "No Fear of Heterogeneity: Classifier Calibration for Federated Learning with Non-IID Data",
NeurIPS 2021, §4: Classifier Calibration with Virtual Representations).

Training is FedAvg's. Before each evaluation the server calibrates the classifier of the global model w^t:
- every client k computes, with w^t in inference mode, the features z of its training rows (the projection output,
  the input of the classifier) and per class c their count N_{c,k}, mean μ_{c,k} = 1/N_{c,k} Σ_j z_j and covariance
  Σ_{c,k} = 1/(N_{c,k} − 1) Σ_j (z_j − μ_{c,k})(z_j − μ_{c,k})^T;
- the server pools them: N_c = Σ_k N_{c,k}, μ_c = Σ_k N_{c,k}/N_c · μ_{c,k},
  Σ_c = Σ_k (N_{c,k} − 1)/(N_c − 1) · Σ_{c,k} + Σ_k N_{c,k}/(N_c − 1) · μ_{c,k} μ_{c,k}^T − N_c/(N_c − 1) · μ_c μ_c^T,
  which is the covariance of class c's features over all clients' rows together;
- it draws M = `samples_per_class` virtual features per class from N(μ_c, Σ_c) and trains the classifier alone (the
  projection fixed) on them with the cross-entropy: `calib_epochs` passes of plain SGD at `calib_lr` over minibatches
  of batch_size rows in a shuffled order;
- clients predict with the global projection and the calibrated classifier. The next round starts from w^t
  uncalibrated: the calibration is post-hoc and never enters training.
Choices the paper leaves open (FL-bench's `src/server/ccvr.py` settles most):
- calibration before every evaluation, from that round's w^t, dropped after scoring (FL-bench's test_client_models;
  the paper calibrates once, after training: the last evaluation is that);
- statistics of every client whatever the round's participation (FL-bench's train_clients), over all its training rows;
- a class with N_c < 2 has no covariance and gets no virtual features (FL-bench);
- x = μ_c + ε Σ_c^{1/2}, ε standard normal from a generator seeded by (seed, round), Σ_c^{1/2} the symmetric square root
  (eigenvalues clamped at 0: Σ_c is singular whenever N_c ≤ proj_dim); FL-bench draws with numpy's
  multivariate_normal (an SVD factor): the same distribution;
- M = 200 (FL-bench's sample_per_class), one epoch, calib_lr = 0.01 (FL-bench: its clients' SGD rate, 0.01 by default),
  no momentum or weight decay, the run's batch_size with the last minibatch short (FL-bench's DataLoader);
- the statistics are pooled in one place: every client's features are computed where the engine holds them, and the
  pooled covariance is computed directly (rows centred on μ_c), not from per-client covariances (the same matrix,
  rounding apart).
Global model: w^t with the calibrated classifier, which every client predicts with (FL-bench's centralized test scores
w^t uncalibrated). Communication: besides the head, each evaluation every client sends N_{c,k}, μ_{c,k} and Σ_{c,k}
for its classes; the engine's upload count holds the head only.

`ccvr-official` matches FL-bench (KarhouTam/FL-bench @ 06e658bc, src/client/ccvr.py, src/server/ccvr.py), whose
clients send Σ_{c,k} with 1/N_{c,k} (`cov(correction=0)`) into the formula above, which assumes 1/(N_{c,k} − 1):
its Σ_c is smaller than the pooled covariance by Σ_k S_{c,k} / (N_{c,k} (N_c − 1)), S_{c,k} client k's scatter.
"""

from __future__ import annotations

import torch
from torch.func import vmap

from ..training.config import Setting
from ..training.schedule import evaluates, hash_keys
from .base import FedAvg, one_hot
from .heads import linear
from .registry import register

CALIBRATION = 1 << 22  # hash_keys' id of the calibration's draws: apart from every training epoch's


def pooled_statistics(
    z: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, K: int, biased: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per class over every client's rows: counts N_c [K], means μ_c [H, K, d] and covariances Σ_c [H, K, d, d] (0 for
    N_c < 2) of the features z [H, C, N, d] (labels, mask [C, N]). `biased`: FL-bench's Σ_c, from client covariances
    with 1/N_{c,k}. One host read (the largest class's rows)."""
    H, C, N, d = z.shape
    hot = one_hot(labels, K) & mask[..., None]  # [C, N, K]
    n_ck = hot.sum(1)  # [C, K] N_{c,k}
    n_c = n_ck.sum(0)  # [K] N_c
    sums = torch.einsum("cnk,hcnd->hckd", hot.to(z.dtype), z)  # [H, C, K, d] Σ_j z_j per client and class
    mean = sums.sum(1) / n_c.clamp(min=1).to(z.dtype)[:, None]  # [H, K, d] μ_c
    # every class's rows side by side: [K, m] indices into the C*N rows, m the largest class's count
    flat = torch.where(mask, labels, K).reshape(-1)  # [C*N] padding sorts last
    order = torch.argsort(flat, stable=True)  # [C*N]
    m = max(int(n_c.max()), 1)
    at = torch.arange(m, device=z.device)  # [m]
    pos = (torch.cumsum(n_c, 0) - n_c)[:, None] + at  # [K, m]
    rows = order[pos.clamp(max=C * N - 1)]  # [K, m]
    weight = (at < n_c[:, None]).to(z.dtype)  # [K, m] 1 for a real row
    if biased:  # (N_{c,k} − 1)/N_{c,k} of row j's scatter about μ_c, from client k = j // N
        weight = weight * (1 - 1 / n_ck[rows // N, torch.arange(K, device=z.device)[:, None]].clamp(min=1).to(z.dtype))
    dev = z.reshape(H, C * N, d)[:, rows] - mean[:, :, None]  # [H, K, m, d] z_j − μ_c
    scatter = dev.mT @ (weight[..., None] * dev)  # [H, K, d, d]
    if biased:  # + Σ_k (μ_{c,k} − μ_c)(μ_{c,k} − μ_c)^T over the clients holding class c
        between = torch.where(n_ck[..., None] > 0, sums / n_ck.clamp(min=1).to(z.dtype)[..., None] - mean[:, None], 0.0)
        scatter = scatter + torch.einsum("hckd,hcke->hkde", between, between)  # [H, C, K, d] -> [H, K, d, d]
    cov = scatter / (n_c - 1).clamp(min=1).to(z.dtype)[:, None, None]  # [H, K, d, d]
    return n_c, mean, torch.where((n_c >= 2)[:, None, None], cov, 0.0)


def symmetric_sqrt(cov: torch.Tensor) -> torch.Tensor:
    """Σ^{1/2} = Q Λ^{1/2} Q^T of symmetric PSD matrices [..., d, d] (negative rounding eigenvalues clamped at 0),
    in float64."""
    lam, q = torch.linalg.eigh(cov.double())
    return (q * lam.clamp(min=0).sqrt()[..., None, :]) @ q.mT


def calibration_draws(seed: int, rnd: int, classes: int, M: int, d: int, epochs: int):
    """One configuration's random numbers for the calibration after round `rnd`: standard normals ε [classes, M, d]
    and each epoch's order of the classes·M virtual rows [epochs, classes·M], from one CPU generator seeded by
    (seed, rnd), so every device draws the same."""
    key = int(hash_keys(torch.tensor([seed]), rnd, CALIBRATION, shape=(1,))[0, 0])
    gen = torch.Generator().manual_seed(key)
    eps = torch.randn(classes, M, d, generator=gen)  # [classes, M, d]
    orders = [torch.randperm(classes * M, generator=gen) for _ in range(epochs)]  # epochs x [classes·M]
    return eps, torch.stack(orders) if orders else torch.zeros(0, classes * M, dtype=torch.long)


def retrain_classifier(
    W: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor, orders: torch.Tensor, lr: torch.Tensor, B: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain SGD on the cross-entropy of the linear classifier (W [H, K, d], b [H, K]) over the virtual features x
    [H, V, d] with labels y [V]: each epoch's minibatches of B rows in the order orders [H, E, V] (the last one
    short), at lr [H]. The closed-form gradient of the batch mean: (softmax − onehot)^T x / |batch|."""
    H, V = x.shape[:2]
    h = torch.arange(H, device=x.device)[:, None]  # [H, 1]
    for e in range(orders.shape[1]):
        for s in range(0, V, B):
            pick = orders[:, e, s : s + B]  # [H, b]
            xb, yb = x[h, pick], y[pick]  # [H, b, d], [H, b]
            scores = torch.baddbmm(b[:, None], xb, W.mT)  # [H, b, K]
            g = (scores.softmax(-1) - one_hot(yb, W.shape[1]).to(x.dtype)) / pick.shape[1]  # [H, b, K]
            W = W - lr[:, None, None] * (g.mT @ xb)  # [H, K, d]
            b = b - lr[:, None] * g.sum(1)  # [H, K]
    return W, b


@register
class CCVR(FedAvg):
    name = "ccvr"
    across_clients = (
        "download pools the feature statistics of every client's training rows, where each holds only its own"
    )
    paper = "Luo et al., No Fear of Heterogeneity: Classifier Calibration for FL with Non-IID Data, NeurIPS 2021, §4"
    uploads = "all head parameters (and, before each evaluation, per class: count, feature mean and covariance)"
    settings = {
        "samples_per_class": Setting(200, "M, virtual features drawn per class (FL-bench's sample_per_class)", lo=1),
        "calib_epochs": Setting(1, "passes of SGD over the virtual features (FL-bench: 1); 0: FedAvg", lo=0),
        "calib_lr": Setting(0.01, "the calibration's SGD rate (FL-bench: its clients' rate, 0.01)", lo=0, lo_open=True),
    }
    fedavg_server = False  # download calibrates the classifier on every client's feature statistics
    biased = False  # FL-bench's client covariances with 1/N_{c,k} (ccvr-official)

    def init_state(self, state, rnd):
        super().init_state(state, rnd)
        state.server["calibrated"] = {k: v[:, 0].clone() for k, v in state.params.items() if k.startswith("cls0")}

    def context(self, state, rnd):
        head = {k: rnd.expand(v) for k, v in state.server["calibrated"].items()}  # [H, C, ...] views
        return super().context(state, rnd) | {"calibrated": head}

    def predict(self, params, buffers, x, ctx):
        z, _ = self.embed(params, buffers, x)
        return linear(ctx["calibrated"], "cls0", z)  # [N, K]

    def download(self, state, server, rnd):
        super().download(state, server, rnd)  # w^t to every client: the next round trains from it
        if evaluates(rnd.round, rnd.cfg):
            with torch.no_grad():
                state.server["calibrated"] = self.calibrate(state, rnd)

    def calibrate(self, state, rnd) -> dict:
        """The classifier of w^t (which every client holds) retrained on virtual features: name -> [H, ...]."""
        data, M, B = rnd.data, self.cfg["samples_per_class"], self.cfg["batch_size"]
        params = {k: v[:, 0] for k, v in state.params.items()}  # [H, ...] w^t
        buffers = {k: v[:, 0] for k, v in state.buffers.items()}
        C, N, D = data.features.shape
        x = data.features.reshape(C * N, D)
        z = vmap(lambda p, s: self.embed(p, s, x)[0])(params, buffers)  # [H, C*N, d] inference mode
        n_c, mean, cov = pooled_statistics(
            z.reshape(rnd.H, C, N, -1), data.labels, data.mask, data.num_classes, self.biased
        )
        classes = (n_c >= 2).nonzero().flatten()  # [K'] the classes with a covariance
        W, b = params["cls0.weight"], params["cls0.bias"]  # [H, K, d], [H, K]
        K_, d, E = len(classes), mean.shape[-1], self.cfg["calib_epochs"]
        if K_ == 0 or E == 0:
            return {"cls0.weight": W.clone(), "cls0.bias": b.clone()}
        draws = [calibration_draws(int(s), rnd.round, K_, M, d, E) for s in rnd.seeds]
        eps = torch.stack([e for e, _ in draws]).to(rnd.device)  # [H, K', M, d]
        orders = torch.stack([o for _, o in draws]).to(rnd.device)  # [H, E, K'·M]
        root = symmetric_sqrt(cov[:, classes])  # [H, K', d, d] float64
        virtual = (mean[:, classes, None].double() + eps.double() @ root).to(mean.dtype)  # [H, K', M, d]
        labels = classes.repeat_interleave(M)  # [K'·M] class by class, as the virtual rows lie
        W, b = retrain_classifier(W, b, virtual.reshape(rnd.H, K_ * M, d), labels, orders, rnd.hp["calib_lr"], B)
        return {"cls0.weight": W, "cls0.bias": b}


@register
class CCVROfficial(CCVR):
    name = "ccvr-official"
    paper = "CCVR as FL-bench releases it (KarhouTam/FL-bench, src/client/ccvr.py, src/server/ccvr.py)"
    uploads = "all head parameters (and, before each evaluation, per class: count, feature mean and covariance)"
    biased = True

"""Prototype helpers shared by the prototype methods (FedPCL, FedProto, FedProc): class means, eq. 6 aggregation,
eq. 7 padding, the server's global prototypes (state.server["prototypes"] [H, K, d], "has" [H, K]), the privacy
noise on uploaded prototypes (Tan et al., FedPCL, NeurIPS 2022, App. A.2.4), and the server's minibatch SGD over the
uploaded prototypes (FedGH's header, FedTGP's trainable prototypes)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import UserError
from ..training.config import Setting
from ..training.models import map_models
from ..training.schedule import batch_order, hash_keys, trained_counts
from .base import bcast, one_hot
from .heads import Params

PASS_EPOCH = 1 << 21  # batch_order's epoch id of the prototype pass: a shuffle of its own, no training epoch's
SERVER_PASS = 1 << 22  # hash_keys' epoch id of the server's first pass over the uploads (pass e: SERVER_PASS + e)


def class_means(z: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5 for one client: prototypes [K, d] (zero for absent classes) and class counts [K]."""
    onehot = (one_hot(y, K) & mask[:, None]).to(z.dtype)  # [N, K]
    counts = onehot.sum(0)  # [K]
    return onehot.T @ z / counts.clamp(min=1)[:, None], counts


def _prototypes_of(algo, K: int):
    """One client's prototypes in eval mode: (params, buffers, x, y, mask) -> ([K, d], counts [K])."""

    def one(params, buffers, x, y, mask):
        z, _ = algo.embed(params, buffers, x)
        return class_means(z, y, mask, K)

    return one


def local_prototypes(algo, state, data, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every model's prototypes of its own training data in eval mode: ([H, C, K, d], counts [H, C, K]); `rows`
    [H, C, N] bool picks each model's rows (default: all of its client's rows)."""
    one = _prototypes_of(algo, data.num_classes)
    if rows is None:
        protos, counts = map_models(one, (state.params, state.buffers), (data.features, data.labels, data.mask))
    else:
        protos, counts = map_models(
            lambda p, b, m, x, y: one(p, b, x, y, m), (state.params, state.buffers, rows), (data.features, data.labels)
        )
    return protos, counts.contiguous()  # (vmap hands back counts that read no parameters broadcast over H)


def refresh_prototypes(algo, state, rnd) -> None:
    """After local training: the prototypes of the round's participants (`rnd.clients`; every client where that is
    None) into state.client["protos"] [H, C, K, d] and ["counts"] [H, C, K]. The others' models have not changed
    since theirs were computed, so theirs stay."""
    if rnd.clients is None or "protos" not in state.client:
        state.client["protos"], state.client["counts"] = local_prototypes(algo, state, rnd.data)
        return
    h, ids, data = torch.arange(rnd.H, device=rnd.device)[:, None], rnd.clients, rnd.data  # ids [H, P]
    take = lambda d: {k: v[h, ids] for k, v in d.items()}  # [H, P, ...]
    protos, counts = map_models(
        _prototypes_of(algo, data.num_classes),
        (take(state.params), take(state.buffers), data.features[ids], data.labels[ids], data.mask[ids]),
    )  # [H, P, K, d], [H, P, K]
    state.client["protos"][h, ids], state.client["counts"][h, ids] = protos, counts


def loader_rows(rnd) -> torch.Tensor:
    """[H, C, N] bool: the rows one pass of a reshuffled training loader yields (the released codes' prototype pass,
    DataLoader(shuffle=True, drop_last=True)): ⌊n/B⌋·B rows of each client drawn by batch_order from (seed, round,
    PASS_EPOCH), all n with drop_last=false or n < B (`schedule.trained_counts`). On the device, no host read."""
    data, B = rnd.data, rnd.cfg["batch_size"]
    N = data.features.shape[1]
    n = trained_counts(data.counts, B, rnd.cfg["drop_last"])  # [C]
    order = batch_order(rnd.seeds.to(rnd.device), rnd.round, PASS_EPOCH, data.counts, N)  # [H, C, N]
    taken = (torch.arange(N, device=rnd.device) < n[:, None]).expand_as(order)  # [H, C, N] by position in the order
    return torch.zeros_like(taken).scatter_(-1, order, taken)


def loader_prototypes(algo, state, rnd) -> tuple[torch.Tensor, torch.Tensor]:
    """`local_prototypes` over the rows of one reshuffled loader pass (`loader_rows`), as the released codes take
    them: ([H, C, K, d], counts [H, C, K])."""
    return local_prototypes(algo, state, rnd.data, loader_rows(rnd))


def global_prototypes(protos: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Eq. 6: C̄_j = 1/|N_j| Σ_{i∈N_j} |D_ij|/N_j · C_i^j, from [H, C, K, d] and counts [H, C, K] -> [H, K, d]."""
    owners = (counts > 0).float().sum(1).clamp(min=1)  # [H, K]  |N_j|
    n_j = counts.sum(1).clamp(min=1)  # [H, K]  N_j
    return (counts[..., None] * protos).sum(1) / (n_j * owners)[..., None]


def mean_prototypes(protos: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Unweighted mean over the clients that own each class (FedProto's aggregation): [H, K, d]."""
    own = (counts > 0).float()  # [H, C, K]
    return (own[..., None] * protos).sum(1) / own.sum(1).clamp(min=1)[..., None]


def pad_prototypes(protos: torch.Tensor, counts: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """Eq. 7: a client's missing class j takes the global prototype C̄_j: [H, C, K, d]."""
    return torch.where(counts[..., None] > 0, protos, glob[:, None])


def empty_global(rnd, d: int) -> dict:
    """No global prototype for any class yet: {"prototypes": zeros [H, K, d], "has": False [H, K]}."""
    H, K, dev = rnd.H, rnd.data.num_classes, rnd.device
    return {"prototypes": torch.zeros(H, K, d, device=dev), "has": torch.zeros(H, K, dtype=torch.bool, device=dev)}


def update_global(
    protos: torch.Tensor, counts: torch.Tensor, part: torch.Tensor, server: dict, average=mean_prototypes
) -> dict:
    """New global prototypes from the participants (part [H, C] bool) of a round; a class none of them owns keeps its
    previous prototype. protos [H, C, K, d], counts [H, C, K] -> {"prototypes": [H, K, d], "has": [H, K] bool}."""
    counts = counts * part[..., None]  # [H, C, K]  participants only
    fresh = counts.sum(1) > 0  # [H, K]
    glob = torch.where(fresh[..., None], average(protos, counts), server["prototypes"])  # [H, K, d]
    return {"prototypes": glob, "has": fresh | server["has"]}


def _laplace(shape, scale: float, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=gen) - 0.5
    return -scale * torch.sign(u) * torch.log1p(-2 * u.abs())


_NOISE = {
    "laplace": _laplace,
    "gaussian": lambda shape, scale, gen: scale * torch.randn(shape, generator=gen),
}

NOISE_SETTINGS = {  # the settings `privatize` reads (FedPCL, NeurIPS 2022, Table 15); per run: one noise draw per seed
    "proto_noise": Setting("none", "noise on uploaded prototypes", choices=("none", *_NOISE)),
    "proto_noise_scale": Setting(0.05, "s, the noise's scale", lo=0, batched=False),
    "proto_noise_p": Setting(
        0.1, "p, the prototypes' shrink: (1 - p) C + noise", lo=0, hi=1, hi_open=True, batched=False
    ),
}


def privatize(protos: torch.Tensor, rnd) -> torch.Tensor:
    """C~ = (1 - p) C + e, e ~ Laplace/Gaussian(0, s) per entry, seeded by (seed, round) (FedPCL, Table 15);
    kind, s, p are the settings proto_noise, proto_noise_scale, proto_noise_p of rnd.cfg."""
    kind, scale, p = rnd.cfg["proto_noise"], rnd.cfg["proto_noise_scale"], rnd.cfg["proto_noise_p"]
    if kind == "none":
        return protos
    if kind not in _NOISE:
        raise UserError(f"proto_noise must be none, laplace or gaussian (got {kind!r})")
    gens = [torch.Generator().manual_seed(s * 100_003 + rnd.round) for s in rnd.seeds.tolist()]  # same seed, noise
    noise = torch.stack([_NOISE[kind](protos.shape[1:], scale, g) for g in gens])  # [H, C, K, d]
    return (1 - p) * protos + noise.to(protos)


def sq_distances(z: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """||z_n − C_k||² for z [N, d], protos [K, d] -> [N, K]."""
    return (z * z).sum(-1, keepdim=True) - 2 * z @ protos.T + (protos * protos).sum(-1)


def server_order(seeds: torch.Tensor, rnd: int, epoch: int, valid: torch.Tensor) -> torch.Tensor:
    """The uploads in the order of the server's pass `epoch` of round `rnd` (the releases' DataLoader(shuffle=True)
    over their list of uploads): valid [H, M] bool (item m = c·K + k, client c's prototype of class k) -> [H, M]
    int64, a random permutation of each model's valid items first, the others after them. `seeds` [H] on the
    device of `valid`."""
    keys = hash_keys(seeds, rnd, SERVER_PASS + epoch, shape=(valid.shape[1],)) >> 1  # [H, M]
    keys = torch.where(valid, keys, torch.iinfo(torch.int64).max)
    return torch.argsort(keys, dim=-1, stable=True)


def server_sgd(
    params: Params,
    loss: Callable[[Params, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    protos: torch.Tensor,
    valid: torch.Tensor,
    rnd,
    lr: torch.Tensor,
    epochs: int,
    batch_size: int,
) -> Params:
    """`epochs` passes of minibatch SGD on the server over the uploaded prototypes protos [H, C, K, d] where valid
    [H, C, K] (the participants' classes), each prototype a sample labelled with its class: every pass in
    `server_order`, `batch_size` prototypes per step (the last one short); the step of each model is
    p ← p − lr_h ∇ loss(p, batch [H, b, d], labels [H, b], mask [H, b])_h (loss -> [H], the mean over the batch's
    masked rows), a model whose rows ran out stays. Returns the trained params name -> [H, ...]; one host read."""
    H, C, K, d = protos.shape
    flat, ok = protos.reshape(H, C * K, d), valid.reshape(H, C * K)  # [H, M, d], [H, M]
    labels = torch.arange(C * K, device=protos.device) % K  # [M]
    n = ok.sum(1)  # [H] uploads per model
    steps = -(-int(n.max()) // batch_size)  # the round's one host read
    seeds = rnd.seeds.to(protos.device)
    params = {k: v.detach().clone() for k, v in params.items()}
    with torch.enable_grad():
        for epoch in range(epochs):
            order = server_order(seeds, rnd.round, epoch, ok)  # [H, M]
            for s in range(0, steps * batch_size, batch_size):
                idx = order[:, s : s + batch_size]  # [H, b]
                mask = s + torch.arange(idx.shape[1], device=idx.device) < n[:, None]  # [H, b]
                x = flat.gather(1, idx[..., None].expand(-1, -1, d))  # [H, b, d]
                leaves = {k: v.requires_grad_(True) for k, v in params.items()}
                grads = torch.autograd.grad(loss(leaves, x, labels[idx], mask).sum(), list(leaves.values()))
                params = {k: (v - bcast(lr, v) * g).detach() for (k, v), g in zip(leaves.items(), grads)}
    return params


def masked_rows_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each model's mean of v [H, b] over its rows where mask [H, b]: [H] (0 where it has none)."""
    m = mask.to(v.dtype)
    return (v * m).sum(1) / m.sum(1).clamp(min=1)

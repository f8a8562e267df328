"""FedPCL's all-pairs prototype terms in chunks of sets (`fedpcl.sum_over_sets`): the loss and every parameter's
gradient equal the plain formula, written here with torch.logsumexp over all sets at once, for client counts that
are and are not a multiple of the chunk, with padding rows, under the engine's two vmaps; and the largest tensor a
step allocates does not grow with the number of sets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import configure
from torch.func import vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from featcache.algorithms import create, fedpcl
from featcache.training.engine import Engine

H, N, D, M, K = 2, 6, 5, 4, 3  # configurations, batch rows, feature width, projection width, classes


def plain_pcl(z, y, glob, sets, tau):
    """Eq. 8 + eq. 9 per row [N]: -z·C^y/τ + log Σ_{a≠y} exp(z·C^a/τ), for the global set and the mean over sets."""

    def contrast(protos):  # [K, d] -> [N]
        s = z @ protos.T / tau  # [N, K]
        pos = F.one_hot(y.clamp(min=0), K).bool() & (y >= 0)[:, None]  # [N, K]
        return -(s * pos).sum(-1) + torch.logsumexp(s.masked_fill(pos, float("-inf")), -1)

    return contrast(glob) + torch.stack([contrast(p) for p in sets]).mean(0)


def plain_conloss(z, y, mask, sets, tau):
    """The released ConLoss on the duplicated batch, summed over sets, as the mean of each row's two anchors [N]."""
    z2, y2, mask2 = torch.cat([z, z]), torch.cat([y, y]), torch.cat([mask, mask])  # [2N, d], [2N], [2N]
    valid = mask2[None, :] & ~torch.eye(2 * N, dtype=torch.bool)  # [2N, 2N]
    pos = (y2[:, None] == y2[None, :]) & valid
    n_pos = pos.sum(-1)  # [2N]
    total = 0
    for protos in sets:
        s = protos[y2.clamp(min=0)] @ z2.T / tau  # [2N, 2N]
        log_prob = s - torch.logsumexp(s.masked_fill(~valid, float("-inf")), -1, keepdim=True)
        total = total + torch.where(n_pos > 0, -(log_prob * pos).sum(-1) / n_pos.clamp(min=1), 0.0)  # [2N]
    return total.reshape(2, N).mean(0)


def setup(algo_name, C, seed=0):
    """H x C models of `algo_name` (no BN) with their own weights, a batch per model with padding rows, the global
    prototypes and C padded sets shared by every client (expanded, as the engine's context holds them)."""
    g = torch.Generator().manual_seed(seed)
    algo = create(algo_name, configure(algo_name, bn=False, proj_dim=M))
    params = {"proj0.weight": torch.randn(H, C, M, D, generator=g), "proj0.bias": torch.randn(H, C, M, generator=g)}
    x = torch.randn(H, C, N, D, generator=g)
    mask = torch.arange(N).expand(H, C, N) < torch.randint(N - 2, N + 1, (H, C, 1), generator=g)  # [H, C, N]
    y = torch.where(mask, torch.randint(0, K, (H, C, N), generator=g), -1)  # padding rows: label -1
    sets = torch.randn(H, C, K, M, generator=g)  # [H, P=C, K, M]
    ctx = {
        "hp": {"tau": torch.full((H, C), 0.5)},
        "prototypes": torch.randn(H, C, K, M, generator=g),
        "padded": sets[:, None].expand(H, C, C, K, M),
        "started": torch.ones(H, C),
    }
    return algo, params, x, y, mask, ctx


def loss_and_grads(algo, params, x, y, mask, ctx):
    """The engine's step: vmap(vmap(local_loss)) over [H, C], then torch.autograd.grad of the sum."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss, _ = vmap(vmap(algo.local_loss))(leaves, {}, x, y, mask, ctx)  # [H, C]
    return loss.detach(), torch.autograd.grad(loss.sum(), list(leaves.values()))


def plain_loss_and_grads(algo_name, params, x, y, mask, ctx):
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    H_, C = x.shape[:2]
    loss = torch.zeros(H_, C)
    for h in range(H_):
        for c in range(C):
            z = torch.relu(x[h, c] @ leaves["proj0.weight"][h, c].T + leaves["proj0.bias"][h, c])  # [N, M]
            tau, m = ctx["hp"]["tau"][h, c], mask[h, c]
            if algo_name == "fedpcl":
                per_row = plain_pcl(z, y[h, c], ctx["prototypes"][h, c], ctx["padded"][h, c], tau)
            else:
                per_row = plain_conloss(F.normalize(z, dim=-1), y[h, c], m, ctx["padded"][h, c], tau)
            loss[h, c] = (per_row * m).sum() / m.sum()
    return loss.detach(), torch.autograd.grad(loss.sum(), list(leaves.values()))


def chunk_of(algo_name, sets):
    """The CHUNK at which `sum_over_sets` takes `sets` sets at a time here."""
    width = N * K if algo_name == "fedpcl" else 2 * N * max(2 * N, M)
    return sets * width


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("algo_name", ["fedpcl", "fedpcl-official"])
@pytest.mark.parametrize("C, sets", [(1, 1), (4, 2), (5, 2), (7, 3), (7, 1), (7, 7)])
def test_chunked_loss_and_gradients_equal_the_plain_formula(algo_name, C, sets, float64, monkeypatch):
    monkeypatch.setattr(fedpcl, "CHUNK", chunk_of(algo_name, sets))
    algo, params, x, y, mask, ctx = setup(algo_name, C)
    assert not mask.all()  # padding rows take part
    loss, grads = loss_and_grads(algo, params, x, y, mask, ctx)
    ref_loss, ref_grads = plain_loss_and_grads(algo_name, params, x, y, mask, ctx)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_prototypes_that_need_a_gradient_are_refused(monkeypatch):
    """The chunks differentiate z only: prototypes that require a gradient would silently get none."""
    monkeypatch.setattr(fedpcl, "CHUNK", chunk_of("fedpcl", 1))
    algo, params, x, y, mask, ctx = setup("fedpcl", 3)
    ctx["padded"] = ctx["padded"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="constants"):
        loss_and_grads(algo, params, x, y, mask, ctx)


class Largest(TorchDispatchMode):
    """The most elements any single op allocates (its outputs' fresh storage; views of its inputs do not count)."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.elements = max(self.elements, t.untyped_storage().nbytes() // t.element_size())
        return out


def largest_in_a_step(algo_name, C):
    algo, params, x, y, mask, ctx = setup(algo_name, C)
    with Largest() as largest:
        loss_and_grads(algo, params, x, y, mask, ctx)
    return largest.elements


@pytest.mark.parametrize("algo_name", ["fedpcl", "fedpcl-official"])
def test_the_largest_allocation_does_not_grow_with_the_clients(algo_name, monkeypatch):
    """Two sets a chunk: a step at 48 clients allocates nothing larger per model than at 4 (the [models, N, C·K]
    scores of the plain formula would be 12 times larger); the same count in one chunk does grow."""
    monkeypatch.setattr(fedpcl, "CHUNK", chunk_of(algo_name, 2))
    small, large = largest_in_a_step(algo_name, 4), largest_in_a_step(algo_name, 48)
    assert large <= 12 * small  # per model (12 times the models) no larger
    monkeypatch.setattr(fedpcl, "CHUNK", chunk_of(algo_name, 48))  # everything in one chunk: the plain formula
    assert largest_in_a_step(algo_name, 48) > 4 * large


@pytest.mark.parametrize("algo_name", ["fedpcl", "fedpcl-official"])
@pytest.mark.parametrize("capture", ["off", "replay"])
def test_a_round_in_chunks_reads_nothing_back_and_trains_as_the_plain_one(
    algo_name, capture, data, host_reads, monkeypatch
):
    """Engine rounds (eager, and captured-and-replayed as a CUDA graph is) with one set a chunk: no host read during
    the local steps, and the models equal those the plain formula trains."""
    train, test = data

    def trained(chunk):
        monkeypatch.setattr(fedpcl, "CHUNK", chunk)
        algo = create(algo_name)
        cfg = configure(algo, proj_dim=8, rounds=2, batch_size=16, drop_last=False)
        eng = Engine(algo, [cfg, cfg | {"seed": 1}], train, test, capture=capture)
        state = eng.init_state()
        with host_reads() as reads:
            for rnd in range(2):
                eng.local_train(state, rnd, [[True] * eng.C] * eng.H)
        assert reads == []
        return state.params

    chunked, plain = trained(1), trained(2**40)
    for k in plain:
        torch.testing.assert_close(chunked[k], plain[k], rtol=1e-5, atol=1e-6)

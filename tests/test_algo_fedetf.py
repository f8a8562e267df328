"""FedETF: the simplex ETF, the balanced feature loss and the local adaptation against the paper's equations written
out with explicit sums (float64), the ETF never trained nor sent, the vectorized engine against the plain per-client
loop, and `fedetf` against a transcription of the authors' release (tests/ref_fedetf.py): its rounds at partial
participation and its closing personalization at its own settings (20 alternations of 3 epochs), with a copy
trained on the plain cross-entropy and one with the phases swapped failing the same comparisons."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import configure
from harness import release_batches
from torch.func import grad

from featcache.algorithms import create
from featcache.algorithms.fedetf import LAST, adaptation_keys, simplex_etf
from featcache.testing import assert_matches_plain_loop, synthetic_clients
from featcache.training.engine import Engine
from featcache.training.evaluate import scores
from featcache.training.schedule import participation
from tests import ref_fedetf

D, P, E, K = 3, 4, 5, 4  # the tiny hand-checked head: input features, projection width, ETF width, classes


def test_the_etf_is_a_simplex_equiangular_tight_frame():
    """Unit columns, pairwise cosines −1/(K−1), columns summing to 0: M^T M = K/(K−1) (I − 11^T/K)."""
    M = simplex_etf(6, 4, torch.Generator().manual_seed(0)).double()  # [d, K]
    gram = M.T @ M
    torch.testing.assert_close(gram, 4 / 3 * (torch.eye(4, dtype=torch.float64) - 1 / 4), atol=1e-6, rtol=0)
    torch.testing.assert_close(M.sum(1), torch.zeros(6, dtype=torch.float64), atol=1e-6, rtol=0)
    with pytest.raises(Exception, match="etf_dim=3 is below the 4 classes"):
        simplex_etf(3, 4, torch.Generator())


def tiny(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"proj0.weight": (P, D), "proj0.bias": (P,), "etfproj0.weight": (E, P), "etfproj0.bias": (E,)}
    p = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    return p | {"etf": simplex_etf(E, K, g).double(), "beta": torch.tensor(1.7, dtype=torch.float64)}


def score_of(p: dict, xn) -> list:
    """s_c = β Σ_i ĥ_i M_ic, ĥ = g / ||g||, g_i = Σ_j V_ij ReLU(Σ_m W_jm x_m + b_j) + c_i, one sample."""
    W, b, V, c = p["proj0.weight"], p["proj0.bias"], p["etfproj0.weight"], p["etfproj0.bias"]
    u = [torch.relu(sum(W[j, m] * xn[m] for m in range(D)) + b[j]) for j in range(P)]
    g = [sum(V[i, j] * u[j] for j in range(P)) + c[i] for i in range(E)]
    norm = torch.sqrt(sum(gi * gi for gi in g))
    return [p["beta"] * sum(g[i] / norm * p["etf"][i, k] for i in range(E)) for k in range(K)]


def paper_loss(p: dict, x, y, counts, balanced: bool = True) -> torch.Tensor:
    """Mean over rows of −log(n_y e^{s_y} / Σ_c n_c e^{s_c}), n_c the client's counts (1 for a class it lacks);
    the plain cross-entropy with balanced=False."""
    n = [max(float(counts[k]), 1.0) if balanced else 1.0 for k in range(K)]
    total = 0.0
    for i in range(len(y)):
        s = score_of(p, x[i])
        total = total - torch.log(
            n[int(y[i])] * torch.exp(s[int(y[i])]) / sum(n[k] * torch.exp(s[k]) for k in range(K))
        )
    return total / len(y)


def data(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 3, 0, 1, 3, 0])  # the client lacks class 2
    return x, y, torch.bincount(y, minlength=K).double()


def test_the_loss_and_its_gradient_are_the_balanced_feature_loss():
    algo = create("fedetf", configure("fedetf", proj_dim=P, etf_dim=E))
    params = tiny(0)
    x, y, counts = data()
    xp, yp = torch.cat([x, torch.zeros(1, D, dtype=x.dtype)]), torch.cat([y, torch.tensor([-1])])  # a padding row
    ctx = {"log_counts": counts.clamp(min=1).log()}
    loss = lambda p: algo.local_loss(p, {}, xp, yp, yp >= 0, ctx)[0]
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    expected = paper_loss(leaves, x, y, counts)
    expected.backward()
    assert abs(float(loss(params)) - float(expected.detach())) < 1e-12
    for k, v in grad(loss)(params).items():
        torch.testing.assert_close(v, leaves[k].grad, rtol=1e-10, atol=1e-12)


def test_the_local_adaptation_is_the_papers_two_steps():
    """Full-batch epochs (batch_size ≥ rows): step 1, E1 steps of SGD with momentum μ and weight decay λ on u, g, β
    (v ← μ v + ∇ + λ w, w ← w − η v) on the balanced loss; step 2, R times: F plain gradient steps on M alone, then F
    momentum steps on g alone from a fresh v, on the cross-entropy. Then the scores of the adapted model."""
    E1, R, F = 2, 2, 2
    lr, mu, decay, lr_etf, lr_proj = 0.3, 0.9, 0.01, 0.5, 0.2
    algo = create("fedetf", configure(
        "fedetf", proj_dim=P, etf_dim=E, batch_size=16, drop_last=False, finetune_epochs=E1, finetune_rounds=R,
        finetune_phase_epochs=F,
    ))  # fmt: skip
    params = tiny(1)
    x, y, counts = data(3)
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)
    hp = {"finetune_lr": f64(lr), "finetune_momentum": f64(mu), "finetune_weight_decay": f64(decay)}
    hp |= {"finetune_etf_lr": f64(lr_etf), "finetune_proj_lr": f64(lr_proj)}
    ctx = {
        "hp": hp, "train_x": x, "train_y": y, "train_count": torch.tensor(6), "train_rows": torch.tensor(6),
        "log_counts": counts.clamp(min=1).log(), "adaptation_keys": adaptation_keys(torch.tensor([0]), 0, 1, 10, 6)[0],
    }  # fmt: skip
    test_x = torch.randn(3, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ours = algo.predict(params, {}, test_x, ctx)

    def steps(p, names, n, rate, momentum, wd, balanced):
        v = {k: 0 for k in names}
        for _ in range(n):
            leaf = {k: t.clone().requires_grad_(k in names) for k, t in p.items()}
            gr = dict(
                zip(names, torch.autograd.grad(paper_loss(leaf, x, y, counts, balanced), [leaf[k] for k in names]))
            )
            v = {k: momentum * v[k] + gr[k] + wd * p[k] for k in names}
            p = p | {k: p[k] - rate * v[k] for k in names}
        return p

    p = steps(
        params, ["proj0.weight", "proj0.bias", "etfproj0.weight", "etfproj0.bias", "beta"], E1, lr, mu, decay, True
    )
    for _ in range(R):
        p = steps(p, ["etf"], F, lr_etf, 0.0, 0.0, False)
        p = steps(p, ["etfproj0.weight", "etfproj0.bias"], F, lr_proj, mu, decay, False)
    expected = torch.stack([torch.stack(score_of(p, test_x[i])) for i in range(3)])
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-10)
    assert not torch.allclose(ours, algo.predict_global(params, {}, test_x, ctx))  # the adaptation moved the model


FAST = {"finetune_epochs": 1, "finetune_rounds": 1, "finetune_phase_epochs": 1}


def test_the_etf_is_never_trained_nor_sent_and_beta_is_learned():
    train, test = synthetic_clients(seed=0), synthetic_clients(seed=1)
    algo = create("fedetf")
    eng = Engine(algo, [configure(algo, proj_dim=8, rounds=2, participation=0.5, lr=1e-2, **FAST)], train, test)
    etf0, beta0 = eng.state.params["etf"][0, 0].clone(), eng.state.params["beta"][0, 0].clone()
    out = eng.run()
    assert "etf" not in eng.algo.upload(eng.state, eng.last_round)
    assert out["upload_floats"][0] == sum(v[0, 0].numel() for k, v in eng.state.params.items() if k != "etf")
    assert torch.equal(eng.state.params["etf"], etf0.expand_as(eng.state.params["etf"]))
    assert float(beta0) == 1.0 and float(eng.state.params["beta"][0, 0]) != 1.0
    torch.testing.assert_close(
        eng.state.params["etf"][0, 0].T @ etf0, 5 / 4 * (torch.eye(5) - 1 / 5), atol=1e-5, rtol=0
    )
    unadapted = Engine(
        algo, [configure(algo, proj_dim=8, rounds=2, participation=0.5, lr=1e-2, finetune_epochs=0, finetune_rounds=0)],
        train, test,
    ).run()  # fmt: skip
    torch.testing.assert_close(out["global_acc"], unadapted["global_acc"])  # the global model is not adapted
    assert not torch.equal(out["acc"], unadapted["acc"])


def test_engine_equals_the_plain_loop():
    """Uneven clients, 75 % participation, a short last batch (featcache.testing's defaults), BN, both steps."""
    train, test = synthetic_clients(C=3, n=(10, 30), D=8, K=3, seed=0), synthetic_clients(C=3, n=(5, 10), D=8, K=3)
    assert_matches_plain_loop(
        "fedetf", 2, train, test, bn=True, finetune_epochs=1, finetune_rounds=1, finetune_phase_epochs=1
    )


# -- the release ----------------------------------------------------------------------------------------------------
C, B, ROUNDS, EPOCHS, RATE, LR, DECAY = 4, 16, 3, 2, 0.5, 0.04, 5e-4
ALTERNATIONS, PHASE_EPOCHS = 2, 2  # the release's 20 x 3, shortened in both (its literals: test_the_defaults_...)
ADAPTATION = EPOCHS + 2 * ALTERNATIONS * PHASE_EPOCHS  # the adaptation's epochs
RUNS: dict = {}


def test_the_defaults_are_the_releases_personalization():
    """20 alternations of 3 epochs (the transcription's literals), SGD rates 0.1 and 0.05, momentum 0.9 and weight
    decay 5e-4 (args.py), training rate 0.04 (args.py), β^0 = 1 and an ETF of K dimensions (its ResNets)."""
    table = {k: s.default for k, s in create("fedetf").settings.items()}
    release = {"finetune_rounds": ref_fedetf.ALTERNATIONS, "finetune_phase_epochs": ref_fedetf.PHASE_EPOCHS}
    release |= {"finetune_etf_lr": 0.1, "finetune_proj_lr": 0.05, "finetune_momentum": 0.9}
    release |= {"finetune_lr": 0.04, "finetune_weight_decay": 5e-4, "beta0": 1.0, "etf_dim": 0}
    assert {k: table[k] for k in release} == release and release["finetune_rounds"] == 20


def release_data():
    return synthetic_clients(C=C, n=(12, 20), D=6, K=3, seed=3), synthetic_clients(C=C, n=(4, 8), D=6, K=3, seed=4)


def featcache_runs():
    """featcache's global model after each round (training at momentum 0) and its clients' adapted scores on their
    test rows at the release's adaptation settings with momentum 0 and 0.9 ([2, C, N, K])."""
    if "ours" not in RUNS:
        train, test = release_data()
        algo = create("fedetf")
        cfg = configure(
            algo, proj_dim=8, rounds=ROUNDS, local_epochs=EPOCHS, batch_size=B, drop_last=False, participation=RATE,
            optimizer="sgd", lr=LR, momentum=0.0, weight_decay=DECAY, finetune_epochs=0, finetune_rounds=0,
        )  # fmt: skip
        eng = Engine(algo, [cfg], train, test)
        RUNS["x0"] = {k: v[0, 0].clone() for k, v in eng.state.params.items()}
        ours = []
        for r in range(ROUNDS):
            eng.run(until=r + 1)
            ours.append({k: v[0, 0].clone() for k, v in eng.state.params.items()})
        RUNS["ours"] = ours
        adapt = cfg | {"finetune_epochs": EPOCHS, "finetune_lr": LR}
        adapt |= {"finetune_rounds": ALTERNATIONS, "finetune_phase_epochs": PHASE_EPOCHS}
        cfgs = [adapt | {"finetune_momentum": 0.0}, adapt | {"finetune_momentum": 0.9}]  # rates: the defaults
        both = Engine(algo, cfgs, train, test)
        both.state.params = {k: v.expand(2, *v.shape[1:]) for k, v in eng.state.params.items()}  # the trained model
        RUNS["adapted"] = scores(both.algo, both.state, test, both.round_context(ROUNDS - 1))  # [2, C, N, K]
    return RUNS["ours"], RUNS["adapted"]


def release_runs(plain_loss: bool = False, swapped: bool = False):
    """The transcription's central network after each round (args.momentum 0), and its personalized scores from the
    last one: with the rounds' nodes (momentum 0) and with fresh nodes at momentum 0.9 ([2][C] of [n, K]).
    `plain_loss`: trained on the plain cross-entropy; `swapped`: alternations that tune linear_proto first."""
    key = (plain_loss, swapped)
    if key in RUNS:
        return RUNS[key]
    train, test = release_data()
    featcache_runs()  # the initial network
    seeds = torch.tensor([0])
    selected = [[c for c in range(C) if participation(seeds, r, C, RATE)[0, c]] for r in range(ROUNDS)]
    N = train.features.shape[1]

    batches = release_batches(train, B, drop_last=False)

    keys = adaptation_keys(seeds, ROUNDS - 1, EPOCHS, ADAPTATION, N)[0]  # [E, N] after the last round

    def adaptation_batches(c, epoch):
        n = int(train.counts[c])
        order = torch.argsort(torch.where(torch.arange(N) < n, keys[epoch], LAST), stable=True)[:n]
        return [(train.features[c, order[s : s + B]], train.labels[c, order[s : s + B]]) for s in range(0, n, B)]

    labels = [train.labels[c, : int(train.counts[c])] for c in range(C)]
    weights = [int(n) for n in train.counts]  # featcache's n_k (the release: each client's whole split)
    args = {"lr": LR, "momentum": 0.0, "local_wd_rate": DECAY, "E": EPOCHS}
    saved = ref_fedetf.balanced_softmax_loss, ref_fedetf.client_personalization
    ref_fedetf.ALTERNATIONS, ref_fedetf.PHASE_EPOCHS = ALTERNATIONS, PHASE_EPOCHS
    try:
        if plain_loss:
            ref_fedetf.balanced_softmax_loss = lambda logits, labels, spc, reduction="mean": F.cross_entropy(
                logits, labels
            )
        rounds, nodes = ref_fedetf.fedetf(RUNS["x0"], selected, labels, 3, weights, batches, args)
        ref_fedetf.balanced_softmax_loss = saved[0]
        if swapped:
            ref_fedetf.client_personalization = swap_phases()
        test_rows = [test.features[c, : int(test.counts[c])] for c in range(C)]
        adapted = []
        for momentum in (0.0, 0.9):
            fresh = [ref_fedetf.Node(rounds[-1], labels[c], 3, args | {"momentum": momentum}) for c in range(C)]
            clients = nodes if momentum == 0.0 else fresh  # the rounds' nodes go on with their optimizers
            ref_fedetf.client_personalization(clients, rounds[-1], EPOCHS, momentum, DECAY, adaptation_batches)
            adapted.append([ref_fedetf.scores(clients[c], test_rows[c]) for c in range(C)])
    finally:
        ref_fedetf.balanced_softmax_loss, ref_fedetf.client_personalization = saved
        ref_fedetf.ALTERNATIONS, ref_fedetf.PHASE_EPOCHS = 20, 3
    RUNS[key] = rounds, adapted, selected
    return RUNS[key]


def swap_phases():
    """A copy of Client_personalization whose alternations fine-tune linear_proto before the proto."""
    import inspect

    source = inspect.getsource(ref_fedetf.client_personalization)
    proto = source[
        source.index("        # finetune the proto") : source.index("        # finetune the projection layer")
    ]
    proj = source[source.index("        # finetune the projection layer") :]
    swapped = source.replace(proto + proj, proj.rstrip("\n") + "\n" + proto)
    space = dict(vars(ref_fedetf))
    exec(swapped, space)
    return space["client_personalization"]


def rounds_difference(ours, ref) -> float:
    return max(float((a[k] - b[k]).abs().max()) for a, b in zip(ours, ref) for k in a)


def scores_difference(adapted, ref) -> float:
    train, test = release_data()
    return max(
        float((adapted[h, c, : int(test.counts[c])] - ref[h][c]).abs().max()) for h in range(2) for c in range(C)
    )


def test_fedetf_is_the_releases_rounds_and_personalization():
    ours, adapted = featcache_runs()
    rounds, ref_adapted, selected = release_runs()
    assert all(0 < len(s) < C for s in selected) and len({tuple(s) for s in selected}) > 1
    assert rounds_difference(ours, rounds) < 2e-6, rounds_difference(ours, rounds)  # measured 6e-8
    assert scores_difference(adapted, ref_adapted) < 5e-6, scores_difference(adapted, ref_adapted)  # measured 7.5e-7
    assert rounds_difference(ours[:1], [RUNS["x0"]]) > 1e-2  # the rounds moved the model


def test_plain_cross_entropy_and_swapped_phases_fail_the_comparison():
    ours, adapted = featcache_runs()
    rounds, _, _ = release_runs(plain_loss=True)
    assert rounds_difference(ours, rounds) > 1e-3
    _, ref_adapted, _ = release_runs(swapped=True)
    assert scores_difference(adapted, ref_adapted) > 1e-3

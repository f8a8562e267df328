"""The stacked optimizers of featcache/training/optim.py: the masked whole-stack ones (`MaskedAdam`, `MaskedSGD`)
equal the fused per-configuration ones (`Adam`, `SGD`) and torch.optim run model by model; models that do not step
are left bit-identical; a masked step reads nothing back from the device and dispatches a number of ops that does not
grow with the number of configurations (`featcache.testing.OpCount`)."""

from __future__ import annotations

import pytest
import torch

from featcache.testing import OpCount
from featcache.training.hparams import HParams
from featcache.training.optim import (
    MASKED,
    OPTIMIZERS,
    SGD,
    Adam,
    Group,
    MaskedAdam,
    MaskedSGD,
    clip_grad_norms,
    clip_sets,
    optimizer_for,
)

H, C = 3, 4
LR, WD, MOM = [1e-2, 3e-2, 1e-1], [1e-4, 0.0, 1e-2], [0.9, 0.0, 0.5]
SCALE = {"b": 0.5}  # a per-name learning-rate factor


def stack(g: torch.Generator, H: int = H, C: int = C) -> dict[str, torch.Tensor]:
    """A tiny head: a weight [H, C, 4, 5] and a bias [H, C, 4]."""
    return {"w": torch.randn(H, C, 4, 5, generator=g), "b": torch.randn(H, C, 4, generator=g)}


def schedule(g: torch.Generator, steps: int) -> list[tuple[torch.Tensor, set]]:
    """Per step (active [H, C], frozen names): everyone steps, clients drop out (so they fall out of step with the
    others of their configuration), a configuration sits out entirely, and the bias is frozen for some steps."""
    out = []
    for s in range(steps):
        active = torch.ones(H, C, dtype=torch.bool) if s in (0, 4) else torch.rand(H, C, generator=g) > 0.35
        if s == 2:
            active[1] = False
        out.append((active, {"b"} if s in (1, 3) else set()))
    return out


def torch_models(p0: dict) -> list[list[dict]]:
    """One set of leaves per (h, c) model, torch.optim's view of the stack."""
    return [[{k: v[h, c].clone().requires_grad_(True) for k, v in p0.items()} for c in range(C)] for h in range(H)]


def torch_optimizers(leaves, opt_name: str):
    """A fresh torch.optim optimizer per model: lr·scale per name, weight decay and momentum of its configuration."""
    make = {
        "adam": lambda groups, h: torch.optim.Adam(groups, lr=LR[h], weight_decay=WD[h]),
        "sgd": lambda groups, h: torch.optim.SGD(groups, lr=LR[h], weight_decay=WD[h], momentum=MOM[h]),
    }[opt_name]
    return [
        [make([{"params": [m[k]], "lr": LR[h] * SCALE.get(k, 1.0)} for k in m], h) for m in row]
        for h, row in enumerate(leaves)
    ]


def torch_step(leaves, opts, grads: dict, active: torch.Tensor, frozen: set) -> None:
    for h in range(H):
        for c in range(C):
            if active[h, c]:
                for k, leaf in leaves[h][c].items():
                    leaf.grad = None if k in frozen else grads[k][h, c].clone()  # None: torch.optim skips it
                opts[h][c].step()


def gather(leaves, k: str) -> torch.Tensor:
    return torch.stack([torch.stack([m[k].detach() for m in row]) for row in leaves])  # [H, C, ...]


def torch_state(leaves, opts, k: str, key: str) -> torch.Tensor:
    """torch.optim's per-model state `key` of parameter k, stacked [H, C, ...] (zeros where a model has none)."""

    def one(h, c):
        leaf = leaves[h][c][k]
        v = opts[h][c].state.get(leaf, {}).get(key)
        return (torch.zeros(()) if key == "step" else torch.zeros_like(leaf)) if v is None else v.detach().float()

    return torch.stack([torch.stack([one(h, c) for c in range(C)]) for h in range(H)])


def counts(opt, k: str) -> torch.Tensor:
    """Steps taken per model [H, C] of parameter k, from either optimizer's bookkeeping."""
    return torch.as_tensor(opt.t[k] if isinstance(opt, (Adam, MaskedAdam, MaskedSGD)) else opt.count[k]).float()


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_masked_equals_fused_equals_torch(opt_name):
    """Two rounds (the second started with `load` from other models) of mixed masks, frozen names, per-config
    hyperparameters, a name scale and gradients in a linear layer's transposed layout: parameters, moments and step
    counts of the masked optimizer equal the fused one's and torch.optim's, model by model."""
    g = torch.Generator().manual_seed(0)
    p0 = stack(g)
    leaves = torch_models(p0)
    masked_p, fused_p = {k: v.clone() for k, v in p0.items()}, {k: v.clone() for k, v in p0.items()}
    masked = fused = None
    state_names = {"adam": (("m", "exp_avg"), ("v", "exp_avg_sq")), "sgd": (("buf", "momentum_buffer"),)}[opt_name]
    hp = HParams.of({"lr": torch.tensor(LR), "weight_decay": torch.tensor(WD), "momentum": torch.tensor(MOM)})
    for rnd in range(2):
        if rnd == 0:
            masked, fused = MASKED[opt_name](masked_p, hp, SCALE), OPTIMIZERS[opt_name](fused_p, hp, SCALE)
        else:  # a new round starts from other models, given as a broadcast view (as a download makes them)
            start = {k: v[:, :1].expand_as(v) for k, v in p0.items()}
            masked_p, fused_p = masked.load(start), fused.load(start)
            leaves = torch_models(start)
        opts = torch_optimizers(leaves, opt_name)
        for active, frozen in schedule(g, 6):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in p0.items()}
            grads["w"] = grads["w"].mT.contiguous().mT  # how autograd returns x @ W.T's weight gradient
            masked_p = masked.step(grads, active, frozen)
            fused_p = fused.step(grads, active, frozen, host=active.tolist())
            torch_step(leaves, opts, grads, active, frozen)
        for k in p0:
            torch.testing.assert_close(masked_p[k], fused_p[k])
            torch.testing.assert_close(masked_p[k], gather(leaves, k))
            torch.testing.assert_close(counts(masked, k), counts(fused, k), rtol=0, atol=0)
            if opt_name == "adam":  # torch.optim.SGD keeps no step count
                torch.testing.assert_close(counts(masked, k), torch_state(leaves, opts, k, "step"), rtol=0, atol=0)
            for ours, theirs in state_names:
                torch.testing.assert_close(getattr(masked, ours)[k], getattr(fused, ours)[k])
                torch.testing.assert_close(getattr(masked, ours)[k], torch_state(leaves, opts, k, theirs))
        assert fused_p["w"].stride() == grads["w"].stride()  # the fused one adopted the gradient's layout
        assert masked_p["w"].stride() == p0["w"].stride()  # the masked one keeps its memory (captured steps find it)


@pytest.mark.parametrize("make", [MaskedAdam, MaskedSGD])
def test_models_that_do_not_step_are_bit_identical(make):
    """Inactive models keep parameters, moments and counts bit for bit, even with a NaN/Inf gradient; a frozen
    name is untouched everywhere."""
    g = torch.Generator().manual_seed(1)
    params = stack(g)
    opt = make(params, HParams.of({"lr": LR, "weight_decay": WD, "momentum": MOM}), scale=SCALE)
    for _ in range(3):  # some history first
        params = opt.step(
            {k: torch.randn(v.shape, generator=g) for k, v in params.items()}, torch.rand(H, C, generator=g) > 0.3
        )
    active = torch.rand(H, C, generator=g) > 0.5
    active[0, 0], active[0, 1] = True, False
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    grads["w"][~active] = float("nan")
    grads["w"][~active, 0, 0] = float("inf")
    names = ("params", "t", *make.state_names)
    before = {name: {k: v.clone() for k, v in getattr(opt, name).items()} for name in names}
    params = opt.step(grads, active, frozen={"b"})
    for name, old in before.items():
        new = getattr(opt, name)
        assert torch.equal(new["b"], old["b"]), f"frozen {name} changed"
        assert torch.equal(new["w"][~active], old["w"][~active]), f"inactive {name} changed"
        assert not torch.equal(new["w"][active], old["w"][active]), f"active {name} unchanged"
    assert torch.isfinite(params["w"]).all()


@pytest.mark.parametrize("make", [MaskedAdam, MaskedSGD])
def test_masked_step_never_reads_the_device(make, host_reads):
    """A step with a device `active` reads no value back (item / local scalar / is_nonzero) and copies nothing to
    the host (tolist / cpu / numpy)."""
    g = torch.Generator().manual_seed(2)
    params = stack(g)
    hp = HParams.of({"lr": torch.tensor(LR), "weight_decay": torch.tensor(WD), "momentum": torch.tensor(MOM)})
    opt = make(params, hp, scale=SCALE)
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    with host_reads() as reads:
        for step in range(3):
            params = opt.step(grads, torch.rand(H, C, generator=g) > 0.4, frozen={"b"} if step else ())
    assert reads == [], reads


def dispatched(make, H_: int, masked: bool) -> int:
    """aten ops dispatched by one optimizer step on a stack of H_ configurations (a later step: the first one also
    adopts the gradients' layout), half of the models active."""
    g = torch.Generator().manual_seed(3)
    params = stack(g, H_)
    hp = HParams.of(
        {
            "lr": torch.linspace(1e-3, 1e-1, H_),
            "weight_decay": torch.full((H_,), 1e-4),
            "momentum": torch.full((H_,), 0.9),
        }
    )
    opt = make(params, hp)
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    active = torch.rand(H_, C, generator=g) > 0.5
    active[:, 0] = True
    host = None if masked else active.tolist()
    opt.step(grads, active, host=host)
    with OpCount() as mode:
        opt.step(grads, active, host=host)
    return len(mode.ops)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_masked_op_count_does_not_grow_with_the_grid(name):
    assert dispatched(MASKED[name], 2, True) == dispatched(MASKED[name], 64, True)
    assert dispatched(OPTIMIZERS[name], 64, False) > 8 * dispatched(OPTIMIZERS[name], 2, False)


def test_optimizer_for_picks_masked_on_cuda_only():
    assert optimizer_for("adam", "cuda") is MaskedAdam and optimizer_for("sgd", torch.device("cuda:0")) is MaskedSGD
    assert optimizer_for("adam", "cpu") is Adam and optimizer_for("sgd", "cpu") is SGD


@pytest.mark.parametrize(
    "algo,extra",
    [
        ("fedavg", {"optimizer": "adam"}),
        ("scaffold", {"optimizer": "sgd", "momentum": 0.9}),
        ("fedpft", {"optimizer": "sgd", "momentum": 0.9}),
    ],
)
def test_engine_on_masked_optimizers_equals_fused(algo, extra, monkeypatch):
    """The engine's wiring: forced onto the masked optimizers (the CUDA choice) on the CPU, a run with uneven clients,
    partial participation, a grid of learning rates and (FedPFT) frozen phases gives the fused run's parameters."""
    from featcache.training import optim
    from featcache.algorithms import create
    from featcache.training.config import resolve
    from featcache.training.engine import Engine
    from tests.synthetic import synthetic_clients

    train, test = synthetic_clients(C=3, n=(20, 45), seed=0), synthetic_clients(C=3, n=(10, 10), seed=1)
    impl = create(algo)
    base = resolve(impl, {"rounds": 2, "batch_size": 8, "participation": 0.67, "drop_last": False} | extra)
    cfgs = [base | {"lr": lr, "seed": s} for lr, s in ((0.01, 0), (0.02, 1))]
    runs = {}
    for kind in ("fused", "masked"):
        if kind == "masked":
            monkeypatch.setitem(optim.BY_DEVICE, "cpu", optim.MASKED)
        engine = Engine(impl, cfgs, train, test)
        out = engine.run()
        runs[kind] = (out["acc"], {k: v.clone() for k, v in engine.state.params.items()})
        assert type(engine.clients.runner.opt).__name__.startswith("Masked") == (kind == "masked")
    assert torch.allclose(runs["fused"][0], runs["masked"][0])
    # Adam divides by √v: a last-bit difference in a near-zero gradient's moments grows to ~2e-5 over two rounds,
    # while a wiring error (another configuration's rate, a model stepping out of turn) moves parameters by ~lr = 1e-2
    # and a bias correction 1 − 0.999^t computed in float32 by ~1e-3.
    for k, v in runs["fused"][1].items():
        torch.testing.assert_close(v, runs["masked"][1][k], rtol=1e-3, atol=1e-4, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_kept_state_equals_torch_optimizers_kept_alive(opt_name):
    """`load(keep=True)` (an algorithm that keeps optimizer state) over three rounds, each started from other
    models, with a parameter group of its own learning-rate and weight-decay settings: masked and fused equal one
    torch.optim optimizer per model built once; non-participants' moments and counts stay as they were."""
    g = torch.Generator().manual_seed(1)
    p0 = stack(g)
    LR_B, WD_B = [0.2, 0.05, 0.3], [0.0, 1e-3, 5e-4]  # the bias group's own settings
    hp = HParams.of(
        {
            "lr": torch.tensor(LR),
            "weight_decay": torch.tensor(WD),
            "momentum": torch.tensor(MOM),
            "lr_b": torch.tensor(LR_B),
            "wd_b": torch.tensor(WD_B),
        }
    )
    groups = {"w": Group(), "b": Group(lr="lr_b", weight_decay="wd_b")}
    masked = MASKED[opt_name]({k: v.clone() for k, v in p0.items()}, hp, groups=groups)
    fused = OPTIMIZERS[opt_name]({k: v.clone() for k, v in p0.items()}, hp, groups=groups)
    leaves = torch_models(p0)
    make = {
        "adam": lambda h, m: torch.optim.Adam(
            [
                {"params": [m["w"]], "lr": LR[h], "weight_decay": WD[h]},
                {"params": [m["b"]], "lr": LR_B[h], "weight_decay": WD_B[h]},
            ]
        ),
        "sgd": lambda h, m: torch.optim.SGD(
            [
                {"params": [m["w"]], "lr": LR[h], "weight_decay": WD[h]},
                {"params": [m["b"]], "lr": LR_B[h], "weight_decay": WD_B[h]},
            ],
            lr=LR[h],
            momentum=MOM[h],
        ),
    }[opt_name]
    opts = [[make(h, m) for m in row] for h, row in enumerate(leaves)]  # built once, kept for every round
    for rnd in range(3):
        start = stack(g)  # the round's starting models (a download)
        masked_p, fused_p = masked.load(start, keep=True), fused.load(start, keep=True)
        with torch.no_grad():
            for h in range(H):
                for c in range(C):
                    for k in p0:
                        leaves[h][c][k].copy_(start[k][h, c])
        for active, _ in schedule(g, 4):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in p0.items()}
            masked_p = masked.step(grads, active)
            fused_p = fused.step(grads, active, host=active.tolist())
            torch_step(leaves, opts, grads, active, set())
    state_name = {"adam": ("m", "exp_avg"), "sgd": ("buf", "momentum_buffer")}[opt_name]
    for k in p0:
        torch.testing.assert_close(masked_p[k], gather(leaves, k))
        torch.testing.assert_close(fused_p[k], gather(leaves, k))
        torch.testing.assert_close(getattr(masked, state_name[0])[k], torch_state(leaves, opts, k, state_name[1]))
        torch.testing.assert_close(getattr(fused, state_name[0])[k], torch_state(leaves, opts, k, state_name[1]))
    fresh = MASKED[opt_name]({k: v.clone() for k, v in p0.items()}, hp, groups=groups)
    fresh.step({k: torch.ones_like(v) for k, v in p0.items()}, torch.ones(H, C, dtype=torch.bool))
    fresh.load(start)  # without keep: zeroed, as a new optimizer
    assert all(not getattr(fresh, state_name[0])[k].any() for k in p0)


def test_clip_grad_norms_is_torch_clip_per_model_and_group():
    """Each model's gradients of each clipped group scaled as torch.nn.utils.clip_grad_norm_ scales them alone; a
    frozen name and an unclipped group are left out."""
    g = torch.Generator().manual_seed(2)
    grads = {
        "w": torch.randn(H, C, 4, 5, generator=g) * 3,
        "b": torch.randn(H, C, 4, generator=g),
        "gate.w": torch.randn(H, C, 3, generator=g) * 5,
        "free": torch.randn(H, C, 2, generator=g) * 9,
    }
    grads["b"][0, 0] *= 1e-3  # a model below the norm: unchanged
    groups = {"": Group(max_norm=2.0), "gate": Group(max_norm=1.0), "free": Group()}
    out = clip_grad_norms(grads, clip_sets(groups, grads), frozen={"w"})
    for h in range(H):
        for c in range(C):
            for names, norm in ((["b"], 2.0), (["gate.w"], 1.0)):
                leaves = [torch.zeros(grads[k].shape[2:], requires_grad=True) for k in names]
                for leaf, k in zip(leaves, names):
                    leaf.grad = grads[k][h, c].clone()
                torch.nn.utils.clip_grad_norm_(leaves, norm)
                for leaf, k in zip(leaves, names):
                    torch.testing.assert_close(out[k][h, c], leaf.grad)
    assert torch.equal(out["w"], grads["w"]) and torch.equal(out["free"], grads["free"])

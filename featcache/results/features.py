"""`featcache plot`: a t-SNE or PCA of the features a trained head learned, per client and class.

Input: a state saved by `featcache train --save-state` (featcache/runs/states.py: `NAME.state.safetensors`, tensors
`params/<name>` and `buffers/<name>` [S, C, ...] for S seeds and C clients, metadata `algo`, `config`, `seeds`,
`cache_key`, `backbones`) and the cache it was trained on. The learned features are the algorithm's own
`embed(params, buffers, x)` (the projection network's output that its classifier reads) of each client's model for
one seed, applied to that client's cached rows of one split. All clients' features are projected together to 2-D,
so positions are comparable across clients; the figure has one panel per client (its points coloured by class over
every client's points in grey). At most `max_points` points are drawn: a random subsample seeded by the seed drawn,
as is t-SNE. An existing output file is replaced only when this command wrote it (its PNG `Software` text says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import check_folder, write_atomic
from ..errors import UserError, suggest
from .figures import PLOT_MARK, figure_png, png_mark

# --split -> the `load_clients` arguments of those rows
SPLITS = {"train": {"split": "train"}, "val": {"split": "train", "holdout": "val"}, "test": {"split": "test"}}
MIN_POINTS = 5  # fewer rows than this make no picture (and no t-SNE)


# -- the saved state -------------------------------------------------------------------------------------------------


def load_state(path: str | Path) -> tuple[dict, dict]:
    """(tensors by name, metadata) of a saved state (`featcache.runs.states.load_state`), refused in one line unless it
    holds the trained heads (`params/` tensors) and metadata of the expected types."""
    from ..runs.states import load_state as read

    tensors, meta = read(path)
    if not (
        isinstance(meta["config"], dict)
        and isinstance(meta["seeds"], list)
        and meta["seeds"]
        and isinstance(meta["backbones"], list)
    ):
        why = "its config, seeds or backbones metadata has the wrong type"
    elif not any(k.startswith("params/") for k in tensors):
        why = "no params/ tensors"
    else:
        return tensors, meta
    raise UserError(
        f"{path} is not a featcache state ({why}): pass the NAME.state.safetensors file that "
        "`featcache train --save-state` writes"
    )


def check_state(path, tensors: dict, meta: dict, name: str, d_in: int, K: int, C: int):
    """The algorithm `name` bound to the state's config, once the state is known to be one it trained: its config
    resolves for that algorithm, its params/ and buffers/ tensors have the names and shapes [S, C, ...] of the
    algorithm's `init` on this cache (D features, K classes), and every parameter is finite. Else one UserError."""
    import torch

    from ..algorithms import create
    from ..training.config import resolve, shared_settings

    fix = "pass the NAME.state.safetensors file `featcache train --save-state` wrote, unchanged"
    impl = create(name)
    try:
        cfg = resolve(impl, meta["config"])
    except UserError as e:
        raise UserError(f"state {path}: its config does not fit algorithm {name} ({e}): {fix}") from None
    with torch.device("meta"):
        params, buffers = impl.init(cfg, d_in, K, torch.Generator())
    lead = (len(meta["seeds"]), C)
    for group, want in (("params", params), ("buffers", buffers)):
        have = {k[len(group) + 1 :]: v for k, v in tensors.items() if k.startswith(group + "/")}
        names = set(want) ^ set(have) if group == "params" else set(want) - set(have)
        if names:
            raise UserError(
                f"state {path} does not hold {name}'s model: {group}/{sorted(names)[0]} is "
                f"{'missing' if sorted(names)[0] in want else 'not one of its tensors'}: {fix}"
            )
        for k, v in want.items():
            if tuple(have[k].shape) != (*lead, *v.shape):
                raise UserError(
                    f"state {path}: {group}/{k} has shape {list(have[k].shape)}, {name} on this cache "
                    f"needs {[*lead, *v.shape]}: {fix}"
                )
            if have[k].is_floating_point() and not bool(torch.isfinite(have[k]).all()):
                raise UserError(
                    f"state {path}: {group}/{k} holds NaN or infinite values (the training diverged, "
                    f"or the file was changed): {fix}"
                )
    return impl.bind(shared_settings(cfg, impl))


def part(tensors: dict, prefix: str, s: int, c: int) -> dict:
    """The `prefix/<name>` tensors of seed s and client c: name -> [...]."""
    return {k[len(prefix) + 1 :]: v[s, c] for k, v in tensors.items() if k.startswith(prefix + "/")}


def cache_facts(cache: str | Path) -> dict:
    """The cache's attributes (key, dataset, classes, per-client counts and domains)."""
    from .. import cache as C

    with C.open_cache(cache) as f:
        return C.read_attrs(f)


# -- the learned features --------------------------------------------------------------------------------------------


@dataclass
class Features:
    """Learned features of every row of one split: z [P, d], the client [P] and class [P] of each row."""

    z: np.ndarray
    client: np.ndarray
    label: np.ndarray
    algo: str
    seed: int
    clients: int
    classes: list
    cache: dict  # the cache's attributes (`cache_facts`): its key, dataset and per-client counts and domains


def _choose(name: str, value, choices) -> None:
    """Refuse `--name value` outside `choices` in one line."""
    if value not in choices:
        names = [str(c) for c in choices]
        raise UserError(f"--{name} {value} is not one of {', '.join(names)}{suggest(str(value), names)}")


def learned_features(state: str | Path, cache: str | Path, split: str = "test", seed: int | None = None) -> Features:
    """The algorithm's `embed` of each client's model (trained seed `seed`, default the first) on that client's rows
    of `split` in `cache`; refused when the state was trained on another cache."""
    import torch

    from ..algorithms import load
    from ..cache import load_clients

    _choose("split", split, SPLITS)
    tensors, meta = load_state(state)
    facts = cache_facts(cache)
    if facts.get("key") != meta["cache_key"]:
        raise UserError(
            f"state {state} was trained on cache {str(meta['cache_key'])[:16]}, not on {cache} "
            f"({str(facts.get('key'))[:16]}): pass --cache the cache it was trained on"
        )
    seed = meta["seeds"][0] if seed is None else seed
    _choose("seed", seed, meta["seeds"])
    s = meta["seeds"].index(seed)
    algo = load(meta.get("algo_spec", meta["algo"]))  # a plug-in's file is imported first
    data = load_clients(cache, **SPLITS[split], backbones=meta["backbones"] or None)
    C = int(data.features.shape[0])
    if next(v for k, v in tensors.items() if k.startswith("params/")).shape[:2] != (len(meta["seeds"]), C):
        raise UserError(
            f"state {state} does not hold {len(meta['seeds'])} seeds x {C} clients of {cache}: pass the "
            "cache it was trained on"
        )
    algo = check_state(state, tensors, meta, algo, data.features.shape[-1], data.num_classes, C)
    zs, clients, labels = [], [], []
    with torch.no_grad():
        for c in range(C):
            n = int(data.counts[c])
            z, _ = algo.embed(part(tensors, "params", s, c), part(tensors, "buffers", s, c), data.features[c, :n])
            zs.append(z.float().numpy())  # [n, d]
            clients.append(np.full(n, c))
            labels.append(data.labels[c, :n].numpy())
    return Features(
        np.concatenate(zs),
        np.concatenate(clients),
        np.concatenate(labels),
        meta["algo"],
        seed,
        C,
        list(facts.get("classes") or range(data.num_classes)),
        facts,
    )


def subsample(n: int, max_points: int, seed: int) -> np.ndarray:
    """Sorted indices of at most `max_points` of n rows, drawn without replacement by a generator seeded by `seed`."""
    if n <= max_points:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, max_points, replace=False))


# -- projections -----------------------------------------------------------------------------------------------------


def pca(z: np.ndarray, seed: int) -> tuple[np.ndarray, list[str]]:
    """The first two principal components of z [P, d] -> ([P, 2], axis labels with their share of the variance)."""
    from sklearn.decomposition import PCA

    fit = PCA(n_components=2, random_state=seed)
    xy = fit.fit_transform(z)  # [P, 2]
    return xy, [f"PC {i + 1} ({100 * v:.1f} % of variance)" for i, v in enumerate(fit.explained_variance_ratio_)]


def tsne(z: np.ndarray, seed: int) -> tuple[np.ndarray, list[str]]:
    """A 2-D t-SNE of z [P, d] (PCA initialisation, perplexity 30 or less for few points), seeded."""
    from sklearn.manifold import TSNE

    perplexity = min(30.0, (len(z) - 1) / 3)
    xy = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(z)  # [P, 2]
    return xy, [f"t-SNE {i} (arbitrary units)" for i in (1, 2)]


METHODS = {"tsne": tsne, "pca": pca}


# -- the output file -------------------------------------------------------------------------------------------------


def default_out(state: str | Path, method: str, split: str) -> Path:
    """NAME.state.safetensors -> NAME.METHOD-SPLIT.png beside it."""
    from ..runs.states import SUFFIX

    state = Path(state)
    stem = state.name.removesuffix(SUFFIX) if state.name.endswith(SUFFIX) else state.stem
    return state.with_name(f"{stem}.{method}-{split}.png")


def check_out(out: Path) -> None:
    """Refuse an output that is not a .png, or an existing file this command did not write (never overwritten)."""
    if out.is_dir():
        raise UserError(f"--out {out} is a folder: pass a file path, e.g. {out / 'features.png'}")
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out}: the figure is a PNG, name it FILE.png")
    if out.exists() and written_by_us(out) is False:
        raise UserError(f"--out {out} exists and was not written by `featcache plot`: pass another --out or move it")
    check_folder(out.parent)


def written_by_us(path: Path) -> bool:
    return png_mark(path) == PLOT_MARK


@dataclass
class Projection:
    """What a figure draws: the learned features, the rows kept [P] and their 2-D coordinates xy [P, 2]."""

    feats: Features
    keep: np.ndarray
    xy: np.ndarray
    axes: list[str]


def project(
    state: str | Path,
    cache: str | Path,
    method: str = "tsne",
    split: str = "test",
    seed: int | None = None,
    max_points: int = 2000,
) -> Projection:
    """The learned features of `state` (one seed) on `cache`'s `split` rows, subsampled and projected to 2-D."""
    _choose("method", method, METHODS)
    if max_points < MIN_POINTS:
        raise UserError(f"--max-points {max_points} is too few: pass at least {MIN_POINTS}")
    feats = learned_features(state, cache, split, seed)
    if len(feats.z) < MIN_POINTS:
        raise UserError(
            f"the {split} split of {cache} has {len(feats.z)} rows: pick a split with at least "
            f"{MIN_POINTS} (--split train)"
        )
    keep = subsample(len(feats.z), max_points, feats.seed)  # [P]
    xy, axes = METHODS[method](feats.z[keep], feats.seed)  # [P, 2]
    return Projection(feats, keep, xy, axes)


def plot(
    state: str | Path,
    cache: str | Path,
    method: str = "tsne",
    split: str = "test",
    seed: int | None = None,
    max_points: int = 2000,
    out: str | Path | None = None,
) -> dict:
    """Draw the learned features of `state` (one seed) on `cache`'s `split` rows with `method` (tsne | pca) to
    `out` (default NAME.METHOD-SPLIT.png beside the state). Returns what was drawn: figure path, method, split,
    seed, points drawn, rows, clients, classes, algo."""
    _choose("method", method, METHODS)
    _choose("split", split, SPLITS)
    out = Path(out) if out is not None else default_out(state, method, split)
    check_out(out)
    p = project(state, cache, method, split, seed, max_points)
    facts = p.feats.cache
    domains = [row.get("domain") for row in (facts.get("counts") or {}).get("clients", [])]
    heading = (
        f"{p.feats.algo}: learned features (embed), {'PCA' if method == 'pca' else 't-SNE'}, seed "
        f"{p.feats.seed}, {split} split, {len(p.keep)} of {len(p.feats.z)} points — {facts.get('dataset')} "
        f"cache {str(facts.get('key'))[:16]}"
    )
    write_atomic(out, figure_png(p.xy, p.feats, p.keep, p.axes, heading, domains))
    return {
        "figure": str(out),
        "method": method,
        "split": split,
        "seed": p.feats.seed,
        "points": int(len(p.keep)),
        "rows": int(len(p.feats.z)),
        "clients": p.feats.clients,
        "classes": len(p.feats.classes),
        "algo": p.feats.algo,
    }

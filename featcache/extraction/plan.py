"""`featcache extract`: partition the images, embed the ones no store holds yet, write one client cache per setting.

Everything that determines an embedding is hashed before any model or image is touched into each backbone's store
key (`identity.py`), and with the partition into the cache key, so a repeated command is a cache hit that costs a
hash and a file lookup. On a miss the partitions are computed (index lists), each backbone's store (`store.py`) is
filled with the images they need and it does not hold (`embed.py`: one decode per image for all backbones), and each
client cache is gathered from the stores' rows (`featcache.cache.write`). A new α, client count or seed therefore
embeds nothing; a sweep (`alpha=[0.1, 0.5, 1]`) writes one cache per setting from one pass of the backbones.

When a run fails: a kill or Ctrl-C keeps the finished blocks (the same command resumes); a full disk keeps them too
and says so in one line; any other error (bad input) removes what this run created. Partial files never survive a
failure that Python sees.
"""

from __future__ import annotations

import itertools
import numbers
import os
import time
import warnings
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np

from .. import cache as C
from ..atomic import check_folder, check_names, make_folder, missing_folders, output_errors, remove_empty
from ..devices import device_kind
from ..errors import UserError, as_list, as_path, comma_values, not_a_file
from . import pipeline as P
from .backbones import check_weights, weights_identity
from .contents import Contents
from .datasets import Dataset, dataset_identity, image_side, keep_dataset, load_dataset
from .embed import BACKENDS, Block, Local, Progress, Ray, Settings
from ..files import DiskFullError, drop_leftover, locked, remove_own, remove_partials, writing
from ..cache.h5 import READ_BYTES
from ..cache.identity import EMBEDDING_CODE, PARTITION_CODE, code_identity, content_key, versions
from .partition import PartitionSpec, make_partition, partition_counts
from .partition.schemes import _SCHEMES as SCHEMES
from .partition.spec import TEST_SPLITS
from .pipeline import Noise
from .store import Need, Store, isin_sorted, store_path
from ..threads import asked, threaded, use_threads

__all__ = ["extract", "Noise", "DiskFullError"]
SPLITS = ("train", "test")
BLOCK_BATCHES = 16  # a block (the unit of resume) is 16 batches of images
SMALL_IMAGES = 64  # images smaller than this are embedded at this size by default (FedPCL's size for its digits)
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 2048  # below: nothing left after a backbone's strides; above: a typo (memory)
# training's default batch_size (training/config.py, which this floor does not import; a test ties the two)
TRAIN_BATCH = 32
SWEPT = {"clients": int, "alpha": float, "per_class": int, "holdout_domain": str}  # a list of values: one cache each
FIXED = [f.name for f in fields(PartitionSpec) if f.name not in ("scheme", "domains", *SWEPT)]  # one value for all


@threaded
def extract(
    dataset: str = "offline-digits",
    backbone: list[str] = ("efficientnet_lite0",),
    partition: str = "feature",
    clients: int | list[int] | str | None = None,
    alpha: float | list[float] | str = 0.5,
    per_class: int | list[int] | str | None = None,
    test_per_class: int | None = None,
    classes_per_client: int = 2,
    domains: list[str] | None = None,
    val_fraction: float = 0.2,
    order: str = "shuffled",
    test_split: str | None = None,
    percent: float | None = None,
    holdout_domain: str | list[str] | None = None,
    image_size: int | None = None,
    views: int = 0,
    noise: Noise | None = None,
    seed: int = 0,
    data_root: str | Path | None = None,
    download: bool = False,
    out: str | Path = "cache",
    store: str | Path | None = None,
    batch_size: int | None = None,
    workers: int | None = None,
    device: str = "auto",
    backend: str = "local",
    allow_partial: bool = False,
    threads: int | None = None,
    progress: Progress | None = None,
    note=None,
) -> dict:
    """Extract (or find cached) embeddings; returns {cache, cache_hit, key, images, backbones, partition, embedded,
    seconds}, and on a miss `phases`: the seconds of each step, summing to `seconds`.

    A list for `clients`, `alpha`, `per_class` or `holdout_domain`, or the command line's comma string ("5,10"), is
    a sweep: one cache per combination, all from one fill of the stores; the result then lists each cache's summary
    under `caches`. `test_split`, `percent` and
    `holdout_domain` are the data sets' own protocols (PartitionSpec); the one in force is told as a note.
    `store` is the folder of the embedding stores (default `out/store`; a shared folder lets a lab share one).
    `batch_size` (images decoded per step) and `workers` (input worker processes) default from the device and the
    dataset; neither changes a byte (every forward holds `pipeline.FORWARD_BATCH` rows). `backend` 'ray' runs the
    blocks as Ray tasks. `allow_partial` loads checkpoints whose keys do not all match (the rest keeps a seeded
    random init). `threads`: the forward's CPU threads (default: one fewer than the cores; featcache/threads.py).
    Without `image_size`, `default_image_size` picks one from the dataset. What was chosen for the user (that size,
    a one-domain partition's domain) is listed under `notes` and passed, one line each, to `note` when known."""
    given = dict(locals())  # the arguments by name: `_plan` resolves them
    t0 = time.perf_counter()
    phases, notes = _Phases(t0), _Notes(note)
    check_options({name: value for name, value in given.items() if name in OPTIONS})
    plan, data = _plan(given, phases)
    if all(p.is_file() for p, _, _ in plan.caches):  # every setting's cache exists: a hash and a file lookup
        return _found(plan, data, notes, t0)
    _refuse_miss(plan, phases)  # a miss writes: what it needs, refused before the dataset is read
    data = data or load_dataset(dataset, plan.data_root, download=download, store=plan.out)
    _refuse_empty_classes(data)
    parts = [make_partition(data, spec) for spec in plan.specs]
    run = _settings(plan, data, noise, seed, batch_size, workers, views, allow_partial)
    phases.lap("dataset")
    with _filling(plan):  # the stores locked; a failure leaves at most their resume point
        added = _fill(plan, _needs(parts, views), data, run, progress, phases)  # images each store gained
        metas = _distinct_keys([s.backbone() for s in plan.stores])  # each backbone as the caches name it
        results = _gather(plan, data, parts, metas, views, t0)
        phases.lap("assembly")
    with suppress(OSError):  # a built-in dataset's next miss reads its arrays instead of building them
        keep_dataset(data, plan.out)
    plan.contents.save()
    _tell(plan, data, notes, parts)  # once written: a refused run (a damaged image met while embedding) says one line
    for spec, spec_parts, r in zip(plan.specs, parts, results):
        for line in (small_clients(spec, spec_parts, plan.specs), untested_clients(spec, spec_parts, plan.specs)):
            if line and not r["cache_hit"]:
                warnings.warn(line, UserWarning, stacklevel=2)
    phases.lap("finish")
    return (
        _summary(results, plan.specs, {m["key"]: n for m, n in zip(metas, added)}, t0)
        | {"phases": {k: round(v, 3) for k, v in phases.items()}}
        | _told(plan, notes, results)
    )


@dataclass(frozen=True)
class _Plan:
    """What an extraction settles before it reads an image or builds a model, handed from step to step: the settings
    and their caches, the backbones with their weights' identities and stores, where data is read and written."""

    data_root: Path | None
    out: Path
    folder: Path  # of the stores, and of the sidecar of the files' hashes (`contents`)
    contents: Contents
    specs: list[PartitionSpec]
    caches: list[tuple[Path, str, dict]]  # each setting's: its path, its key, and the manifest that key hashes
    backbones: tuple[str, ...]
    weights: list[dict]
    stores: list[Store]  # two backbones of the same weights share one
    embedding: dict  # what determines one image's embedding by one backbone, but the backbone itself
    runner: Local | Ray
    device: str
    size_note: str | None  # the image size chosen for the user, told when the run ends well

    @property
    def own(self) -> list[Store]:
        """Each store once, in the backbones' order."""
        return list(dict.fromkeys(self.stores))


def _plan(given: dict, phases: _Phases) -> tuple[_Plan, Dataset | None]:
    """extract()'s arguments (`given`, by name) resolved into its plan, and the dataset when identifying it read it
    (data on disk, identified by content): each store and cache is named by its key, so no model is built here."""
    specs, backbones, out, data_root, folder = _arguments(given)
    dataset, noise, views, seed = given["dataset"], given["noise"], given["views"], given["seed"]
    runner = BACKENDS[given["backend"]]()
    dev = runner.device(given["device"])  # its name: torch is loaded only by a pass that embeds
    contents = Contents(folder)
    phases.lap("setup")
    identity, data = dataset_identity(dataset, data_root, given["download"], contents)
    phases.lap("identity")
    image_size, size_note = given["image_size"], None
    if image_size is None:
        image_size, size_note = default_image_size(dataset, image_side(dataset, data))
    embedding = {  # what determines one image's embedding by one backbone, but the backbone itself
        "dataset": identity,
        "image_size": image_size,
        "views": views,
        "noise": asdict(noise) if noise else None,
        "seed": seed if noise or views else None,  # the seed of the noise and the views, else of nothing embedded
        "pipeline": P.DESCRIPTION,
        "code": code_identity(EMBEDDING_CODE)["sha256"],
        "precision": "float16" if device_kind(dev) == "cuda" else "float32",  # CUDA runs under fp16 autocast
        "allow_partial": given["allow_partial"],
        "versions": versions(),
    }
    weights = [weights_identity(b) for b in backbones]
    by_path: dict[Path, Store] = {}  # two specs of the same weights share one store
    source = _source(data_root) if data is not None else None  # a built-in recipe reads no folder
    stores = [
        by_path.setdefault(path, Store(path, key, source))
        for w in weights
        for key in [content_key(embedding | {"backbone": w})]
        for path in [store_path(folder, dataset, w["name"], key)]
    ]
    common = {"seed": seed, "backbones": weights, "code": code_identity(EMBEDDING_CODE + PARTITION_CODE)["sha256"]}
    manifests = [embedding | {"partition": spec.to_dict()} | common for spec in specs]
    caches = [(C.cache_path(out, dataset, key), key, m) for m in manifests for key in [content_key(m)]]
    return _Plan(
        data_root, out, folder, contents, specs, caches, backbones, weights, stores, embedding, runner, dev, size_note
    ), data


def _arguments(given: dict) -> tuple[list[PartitionSpec], tuple[str, ...], Path, Path | None, Path]:
    """The settings (one PartitionSpec each: a list of `clients`, `alpha`, `per_class` or `holdout_domain` values, or
    the command line's comma string "5,10", is a sweep), the backbones, and the folders `out`, `data_root` and the
    stores' (`store`, default `out/store`), each argument refused in one line when it is not one."""
    swept = {name: comma_values(given[name], kind, "--" + name.replace("_", "-")) for name, kind in SWEPT.items()}
    backbones = [given["backbone"]] if isinstance(given["backbone"], str) else list(given["backbone"])
    if not backbones:
        raise UserError("no backbone given: pass --backbone NAME (e.g. efficientnet_lite0)")
    if len(set(backbones)) != len(backbones):
        raise UserError(f"backbone listed twice in {backbones}: give each once")
    out = as_path(given["out"], "out")
    data_root, store = (None if given[name] is None else as_path(given[name], name) for name in ("data_root", "store"))
    domains = as_list(given["domains"], "domains")  # domains="mnist" is one domain, not five letters
    for path, flag in ((out, "--out"), (store, "--store"), (data_root, "--data-root")):
        if path is not None:
            check_names(path, flag)
    fixed = {name: given[name] for name in FIXED} | {"domains": tuple(domains) if domains else None}
    specs = [
        PartitionSpec(given["partition"], **fixed, **dict(zip(swept, values)))
        for values in itertools.product(*(v if isinstance(v, (list, tuple)) else [v] for v in swept.values()))
    ]
    return specs, tuple(backbones), out, data_root, store or out / "store"


def _found(plan: _Plan, data, notes: _Notes, t0: float) -> dict:
    """Every setting's cache exists: a killed fill's leftovers dropped, the notes told, the caches summarized."""
    for s in plan.own:
        drop_leftover(s.work)
    results = [_hit(p, k, t0) for p, k, _ in plan.caches]
    _tell(plan, data, notes)
    plan.contents.save()  # a run that ends well keeps the files' hashes (a refused one changes nothing)
    return _summary(results, plan.specs, {}, t0) | _told(plan, notes, results)


def _refuse_miss(plan: _Plan, phases: _Phases) -> None:
    """What a miss needs, refused in seconds before the dataset is read or anything is created: folders it can write,
    no user's folder, pipe or link named like a store, and the weights of each backbone no store proves was built."""
    check_folder(plan.out)
    check_folder(plan.folder, "--store")
    for s in plan.own:
        if os.path.lexists(s.path) and (why := not_a_file(s.path)) is not None:
            raise UserError(
                f"{s.path} {why}, and featcache keeps a store under that name: move it, or pass --store another folder"
            )
    phases.lap("setup")
    for b, s in zip(plan.backbones, plan.stores):  # a store's key proves its backbone was built (timm not imported)
        if not s.path.is_file():
            check_weights(b)
    phases.lap("weights")  # importing timm, most of it


def _settings(plan: _Plan, data, noise, seed: int, batch_size, workers, views: int, allow_partial: bool) -> Settings:
    """The embedding pass's settings; the batch and the input workers, unless given, from the device and the data."""
    size, batch = plan.embedding["image_size"], batch_size or P.default_batch_size(plan.device)
    workers = P.default_workers(data, views) if workers is None else workers
    meta_files = tuple(s.work / "meta.json" for s in plan.stores)
    return Settings(plan.backbones, size, noise, seed, batch, workers, plan.device, allow_partial, meta_files)


@contextmanager
def _filling(plan: _Plan):
    """The stores locked for a fill and the gathers from it (one lock order: two extractions never deadlock). On a
    failure their partial files are removed, and on bad input all this run made; a kill, Ctrl-C or full disk keeps
    the finished blocks, the resume point. On success their parts folders are removed."""
    own = plan.own
    with output_errors(plan.folder, "--store"), _made(plan.out, *(s.path.parent for s in own)), ExitStack() as held:
        resumable = {s.path: (s.work / "plan.json").is_file() for s in own}
        for s in sorted(own, key=lambda s: s.path):
            held.enter_context(locked(s.work))
        try:
            yield
        except BaseException as e:
            for s in own:
                remove_partials(s.work)
                if not (resumable[s.path] or isinstance(e, (KeyboardInterrupt, DiskFullError))):
                    with suppress(OSError):  # bad input: nothing of this run is worth keeping
                        remove_own(s.work)
            kept = [str(s.work) for s in own if any(s.work.glob("*.npy"))]
            if isinstance(e, DiskFullError) and kept:  # say where the resume point is, and how to drop it
                where = (
                    f"the finished blocks are kept in {', '.join(kept)} and resumed (rm -r the folder to start "
                    "over instead)"
                )
                said = str(e).replace("finished blocks are kept and resumed", where)
                raise DiskFullError(said if where in said else f"{said}; {where}") from None
            raise
        for s in own:
            remove_own(s.work)


def _gather(plan: _Plan, data, parts, metas: list[dict], views: int, t0: float) -> list[dict]:
    """Each setting's cache gathered from the stores' rows; one another extraction wrote meanwhile is a hit."""
    return [
        _hit(p, k, t0) if p.is_file() else _write(p, k, m, data, spec_parts, plan.stores, metas, views, t0)
        for (p, k, m), spec_parts in zip(plan.caches, parts)
    ]


class _Notes(list):
    """What was chosen for the user, one line each: kept for the result, and passed to `note` (when given) as told."""

    def __init__(self, note: Callable[[str], object] | None) -> None:
        super().__init__()
        self.note = note or (lambda line: None)

    def tell(self, line: str) -> None:
        self.append(line)
        self.note(line)


def _tell(plan: _Plan, data, notes: _Notes, parts=None) -> None:
    """The image size chosen for the user, and the data set's protocol in force (`protocol_notes`)."""
    for line in ([plan.size_note] if plan.size_note else []) + protocol_notes(plan.specs, data, parts):
        notes.tell(line)


def _source(data_root: Path | None) -> dict | None:
    """Where the images are read from, for the store's metadata (never its key): the root as an absolute path and,
    when links or `..` make it another folder, the real one."""
    if data_root is None:
        return None
    root, real = os.path.abspath(data_root), os.path.realpath(data_root)
    return {"root": root} | ({"real": real} if real != root else {})


def default_image_size(dataset: str, side: int | None) -> tuple[int | None, str]:
    """The input size when none is given, and the one line that says it: images smaller than SMALL_IMAGES px are
    embedded at SMALL_IMAGES px (a backbone's own 224 px or more would cost over 12x the compute and add no
    detail); larger ones, or of unknown size, at each backbone's own pretrained input size (None)."""
    if side and side < SMALL_IMAGES:
        return SMALL_IMAGES, (
            f"image size {SMALL_IMAGES} ({dataset} images are {side} px; a backbone's own input "
            f"size, typically 224, would cost over 12x more; --image-size N to change)"
        )
    size = f"{dataset} images are {side} px" if side else f"the size of {dataset} images is unknown"
    return None, f"image size: each backbone's own input size ({size}; --image-size N to change)"


def _told(plan: _Plan, notes: _Notes, results: list[dict]) -> dict:
    """The domain a one-domain partition used when none was named, told; the notes and the image size used (None:
    each backbone's own) for the result."""
    spec = plan.specs[0]
    if not spec.domains and not SCHEMES[spec.scheme].multi_domain:
        notes.tell(
            f"partition {spec.scheme} splits one domain: {results[0]['domains'][0]}, the dataset's first "
            "(--domains NAME picks another)"
        )
    return {"image_size": plan.embedding["image_size"], "notes": list(notes)}


def protocol_notes(specs: list[PartitionSpec], data, parts=None) -> list[str]:
    """The data set's protocol in force, one line each: the reader's (PACS's kfold lists or a seeded split), the
    test split of a multi-domain partition, FedBN's percent, a held-out domain (with its image count when the
    partition is known: `parts`, one list per spec)."""
    lines = list((data.extra.get("notes") or []) if data is not None else [])
    spec = specs[0]
    if spec.percent is not None:
        rule = "FedBN's train_part files" if data is not None and data.extra.get("train_parts") else "a prefix"
        lines.append(f"percent={spec.percent:g}: clients draw from that share of each domain's train split ({rule})")
    held = [s.holdout_domain for s in specs if s.holdout_domain is not None]
    if held:
        sizes = [len(p[0].test) + len(p[0].test_train) for p in parts] if parts else []
        count = ", ".join(f"{h}: {n} images" for h, n in zip(held, sizes)) or ", ".join(held)
        lines.append(
            "leave-one-domain-out: clients train on the other domains and every client is tested on the whole "
            f"held-out domain, its train and test splits ({count})"
        )
    elif SCHEMES[spec.scheme].multi_domain or spec.test_split is not None:
        other = next(k for k in TEST_SPLITS if k != spec.tests_on)
        lines.append(f"test split {spec.tests_on}: {TEST_SPLITS[spec.tests_on]} (--test-split {other} to change)")
    return lines


def small_clients(spec: PartitionSpec, parts, specs: list[PartitionSpec]) -> str:
    """One line naming the clients of `spec` with fewer training images than training's default batch ("" when
    none); in a sweep, led by the partition values that tell this cache from the others."""
    small = [(i, len(p.train)) for i, p in enumerate(parts) if len(p.train) < TRAIN_BATCH]
    if not small:
        return ""
    more = f" and {len(small) - 5} more" if len(small) > 5 else ""
    who = ", ".join(f"client {i} ({n})" for i, n in small[:5]) + more
    return (
        f"{_which_cache(spec, specs)}{who} hold{'s' if len(small) == 1 else ''} fewer training images than a batch of "
        f"{TRAIN_BATCH} (training's default batch_size): such a client trains on all of them in one step per round"
    )


def untested_clients(spec: PartitionSpec, parts, specs: list[PartitionSpec]) -> str:
    """One line naming the clients of `spec` without a test image ("" when none): `train` refuses such a cache (a
    client's accuracy would be 0 of 0), so it is said here, not minutes later."""
    empty = [i for i, p in enumerate(parts) if len(p.test) + len(p.test_train) == 0]
    if not empty:
        return ""
    more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
    return (
        f"{_which_cache(spec, specs)}{len(empty)} of {len(parts)} clients hold no test image, client {empty[0]}{more} "
        "first, and train refuses this cache: extract fewer clients or a milder partition (a larger alpha)"
    )


def _which_cache(spec: PartitionSpec, specs: list[PartitionSpec]) -> str:
    """In a sweep, "cache K=V, ...: " naming the partition values that tell `spec`'s cache from the others."""
    differ = [k for k, v in spec.to_dict().items() if any(s.to_dict()[k] != v for s in specs)]
    return f"cache {', '.join(f'{k}={spec.to_dict()[k]}' for k in differ)}: " if differ else ""


def _whole(least: int, none: bool = False) -> Callable[[object], bool]:
    return lambda v: (
        (none and v is None) or (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= least)
    )


def _is(*types: type) -> Callable[[object], bool]:
    return lambda v: isinstance(v, types) and (bool in types or not isinstance(v, bool))


# extract()'s own options -> (what a value must be, its test); the partition's options are PartitionSpec's. The
# command line, the Python API and pipeline files are checked against this one declaration.
OPTIONS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "dataset": ("a dataset name (a string)", _is(str)),
    "backbone": (
        "a backbone name or a list of them (strings)",
        lambda v: isinstance(v, str) or isinstance(v, (list, tuple)) and all(isinstance(b, str) for b in v),
    ),
    "image_size": (
        f"a whole number of pixels from {MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE}",
        lambda v: _whole(MIN_IMAGE_SIZE, none=True)(v) and (v is None or v <= MAX_IMAGE_SIZE),
    ),
    "views": ("a whole number >= 0", _whole(0)),
    "batch_size": ("a whole number >= 1", _whole(1, none=True)),
    "workers": ("a whole number >= 0", _whole(0, none=True)),
    "threads": ("a whole number >= 1", _whole(1, none=True)),
    "noise": ("laplace or gaussian noise with its scale and p", lambda v: v is None or isinstance(v, Noise)),
    "download": ("true or false", _is(bool)),
    "allow_partial": ("true or false", _is(bool)),
    "device": ("a device name (auto, cpu, cuda or cuda:N)", _is(str)),
    "backend": (f"one of {', '.join(BACKENDS)}", lambda v: isinstance(v, str) and v in BACKENDS),
}
_HINTS = {"image_size": "; omit it for the backbone's own size"}


def check_options(options: dict, flags: bool = True) -> None:
    """One line naming the first option of `options` (extract()'s own, see OPTIONS) whose value is not allowed, as
    the command line's flag (`flags`) or as the key of a pipeline file."""
    for name, value in options.items():
        what, ok = OPTIONS[name]
        if not ok(value):
            label = "--" + name.replace("_", "-") if flags else name
            raise UserError(f"{label} must be {what} (got {value!r}){_HINTS.get(name, '')}")


def _refuse_empty_classes(data) -> None:
    """A class without a single image in any domain could be neither learned nor tested (an empty class folder)."""
    seen = sum(
        np.bincount(images.labels, minlength=len(data.classes))[: len(data.classes)]
        for splits in data.domains.values()
        for images in splits.values()
    )  # [K] images per class
    empty = [c for c, n in zip(data.classes, seen) if n == 0]
    if empty:
        raise UserError(
            f"{data.name}: class {empty[0]!r} has no images in any domain (an empty class folder?): "
            "add images of it or remove it"
        )


@contextmanager
def _made(*folders: Path):
    """`folders` made, with their missing parents; on bad input (not a kill, Ctrl-C or full disk, which keep their
    resume point) those this run created are removed again when empty."""
    made = [missing_folders(p) for p in folders]
    try:
        for p in folders:
            make_folder(p)
        yield
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, DiskFullError)):
            for m in made:
                remove_empty(m)
        raise


def _needs(parts_by_setting, views: int) -> dict[Need, np.ndarray]:
    """(domain, split, views) -> the source indices any setting's clients hold (sorted, unique)."""
    rows: dict[Need, list] = {}
    for parts in parts_by_setting:
        for part in parts:
            for split in SPLITS if not part.test_domain else [s for s in SPLITS if s != "test"]:
                kinds = (0, views) if views and split == "train" else (0,)
                for v in kinds:
                    rows.setdefault((part.domain, split, v), []).append(getattr(part, split))
            if part.test_domain:  # a held-out domain: its test split stands in for the client's, with its train split
                rows.setdefault((part.test_domain, "test", 0), []).append(part.test)
                rows.setdefault((part.test_domain, "train", 0), []).append(part.test_train)
    return {need: np.unique(np.concatenate(r)).astype(np.int64) for need, r in rows.items()}


def _fill(plan: _Plan, needs: dict[Need, np.ndarray], data, run: Settings, progress, phases: _Phases) -> list[int]:
    """Embed what `needs` asks for and the stores do not hold, one decode per image for all backbones; returns the
    images each backbone's store gained (a killed fill's finished blocks are committed first)."""
    phases.lap("plan")  # of the stores, waiting for another extraction's lock included
    first = {s: plan.stores.index(s) for s in plan.own}  # each store is filled by its first backbone
    identities = {s: plan.embedding | {"backbone": plan.weights[j]} for s, j in first.items()}
    held = [s.held(pending=True) for s in first]  # a killed fill's finished blocks are committed with this fill's
    blocks: list[tuple[Need, np.ndarray, tuple[int, ...]]] = []
    rows_per_block = BLOCK_BATCHES * run.batch_size
    for need, rows in needs.items():
        missing = np.stack([~isin_sorted(rows, h.get(need, np.zeros(0, np.int64))) for h in held], 1)  # [n, stores]
        for pattern in sorted({tuple(m) for m in missing if m.any()}, reverse=True):
            mine = rows[(missing == pattern).all(1)]  # the rows exactly these stores need
            js = tuple(j for j, m in zip(first.values(), pattern) if m)
            blocks += [(need, mine[r : r + rows_per_block], js) for r in range(0, len(mine), rows_per_block)]
    if blocks:
        files = {j: iter(s.plan([(need, rows) for need, rows, js in blocks if j in js])) for s, j in first.items()}
        jobs = [Block(d, sp, v, rows, {j: next(files[j]) for j in js}) for (d, sp, v), rows, js in blocks]
        phases.lap("plan")
        with use_threads(asked(), load=True):  # --threads: set in torch once a pass loads it (featcache/threads.py)
            plan.runner.embed(jobs, data, run, progress, phases)  # adds its own models and embedding seconds
        phases.mark = time.perf_counter()
    added = {s: s.commit(identities[s]) for s in first}
    phases.lap("commit")
    return [added[s] for s in plan.stores]


class _Phases(dict):
    """Seconds by phase, in the order they run, for the report: each lap ends a phase where the next begins, so the
    phases sum to the total."""

    def __init__(self, t0: float):
        names = "setup identity weights dataset plan models embedding commit assembly finish".split()
        super().__init__(dict.fromkeys(names, 0.0))
        self.mark = t0

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self[name] += now - self.mark
        self.mark = now


def _distinct_keys(metas: list[dict]) -> list[dict]:
    """Backbones whose keys coincide (two checkpoints named alike in different folders) get '-2', '-3', ... in the
    order given, so each has its own group and columns."""
    seen: dict[str, int] = {}
    out = []
    for meta in metas:
        n = seen[meta["key"]] = seen.get(meta["key"], 0) + 1
        out.append(meta if n == 1 else meta | {"key": f"{meta['key']}-{n}"})
    return out


def _write(
    path: Path, key: str, manifest: dict, data, parts, stores: list[Store], metas: list[dict], views: int, t0: float
) -> dict:
    """One client cache gathered from the stores' rows (`cache.write`: hashed as written, synced, renamed)."""
    domains = list(dict.fromkeys(p.domain for p in parts))  # the domains clients hold, in client order
    domains += [d for d in dict.fromkeys(p.tested_on for p in parts) if d not in domains]  # then a held-out one
    header = {
        "key": key,
        "manifest": manifest,
        "dataset": data.name,
        "classes": list(data.classes),
        "domains": domains,
        "partition": manifest["partition"],
        "counts": partition_counts(data, parts),
        "views": views,
        "versions": manifest["versions"],
    }

    row_bytes = 4 * sum(int(m["dim"]) for m in metas) * max(views, 1)  # float32 columns of every backbone
    own = {name: _Gathered(parts, name, 0, stores, row_bytes) for name in SPLITS}
    augmented = _Gathered(parts, "train", views, stores, row_bytes) if views else None
    held: dict = {}  # a held-out domain's rows: every client's test split, gathered once

    def clients():
        for i, part in enumerate(parts):

            def split(name: str) -> C.Split:
                rows = getattr(part, name)
                extra = augmented.take(i) if augmented and name == "train" else None
                return C.Split(data.domains[part.domain][name].labels[rows], rows, own[name].take(i), extra)

            key = (part.test_domain, id(part.test), id(part.test_train))  # every client's: the same arrays
            if not part.test_domain:
                test = split("test")
            elif key not in held:
                test = held[key] = _held_out(data, part, stores)
            else:
                test = held[key]
            yield C.Client(part.domain, split("train"), test, part.val)

    with writing(path):
        images = C.write(path, header, metas, clients())
    return _result(path, False, key, images, [m["key"] for m in metas], domains, t0)


class _Gathered:
    """Each client's rows of its own domain's split `name` (`views`: 0 plain, V augmented) from every store, gathered
    for consecutive clients of a domain together, about `READ_BYTES` of rows a batch: one gather per batch and store,
    not per client. `take(i)` hands out client i's rows once ([store] views of its batch's arrays)."""

    def __init__(self, parts, name: str, views: int, stores: list[Store], row_bytes: int) -> None:
        self.parts, self.name, self.views, self.stores = parts, name, views, stores
        self.batch: dict[int, list[int]] = {}  # client -> the clients gathered with it
        self.held: dict[int, list[np.ndarray]] = {}  # client -> its rows from each store, gathered, not taken yet
        last: dict[str, tuple[list[int], int]] = {}  # domain -> its open batch and that batch's rows
        for i, part in enumerate(parts):
            if name == "test" and part.test_domain:  # tested on a held-out domain (`_held_out`)
                continue
            batch, n = last.get(part.domain, ([], 0))
            if batch and (n + len(getattr(part, name))) * row_bytes > READ_BYTES:
                batch, n = [], 0
            batch.append(i)
            self.batch[i] = batch
            last[part.domain] = (batch, n + len(getattr(part, name)))

    def take(self, i: int) -> list[np.ndarray]:
        if i not in self.held:
            batch, need = self.batch[i], (self.parts[i].domain, self.name, self.views)
            lists = [getattr(self.parts[j], self.name) for j in batch]  # each [n_j] increasing
            rows = [s.gather(need, np.concatenate(lists)) for s in self.stores]  # each [sum n_j, (V,) D]
            ends = np.cumsum([len(x) for x in lists])
            self.held |= {j: [r[e - len(x) : e] for r in rows] for j, x, e in zip(batch, lists, ends)}
        return self.held.pop(i)


def _held_out(data, part, stores: list[Store]) -> C.Split:
    """A client's test split from the held-out domain: its test split's rows, then its train split's (their source
    indices offset by the test split's size, so each names one image of the domain)."""
    d, splits = part.test_domain, data.domains[part.test_domain]
    return C.Split(
        np.concatenate([splits["test"].labels[part.test], splits["train"].labels[part.test_train]]),
        np.concatenate([part.test, part.test_train + len(splits["test"])]),
        [
            np.concatenate([s.gather((d, "test", 0), part.test), s.gather((d, "train", 0), part.test_train)])
            for s in stores
        ],
        domain=d,
    )


def _hit(path: Path, key: str, t0: float) -> dict:
    with C.open_cache(path) as f:
        attrs = C.read_attrs(f)
        return _result(path, True, key, int(f.attrs["images"]), attrs["backbones"], attrs["domains"], t0)


def _result(path: Path, hit: bool, key: str, images: int, keys: list[str], domains: list[str], t0: float) -> dict:
    return {
        "cache": str(path),
        "cache_hit": hit,
        "key": key,
        "images": images,
        "backbones": keys,
        "domains": domains,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _summary(results: list[dict], specs: list[PartitionSpec], embedded: dict, t0: float) -> dict:
    """One setting: its result; a sweep: every setting's under `caches`, each with its partition (α, clients, ...).
    Both say what each backbone embedded."""
    seconds = round(time.perf_counter() - t0, 3)
    results = [r | {"partition": spec.to_dict()} for r, spec in zip(results, specs)]
    head = results[0] if len(results) == 1 else {"caches": results, "cache_hit": all(r["cache_hit"] for r in results)}
    return head | {"embedded": embedded, "seconds": seconds}

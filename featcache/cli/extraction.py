"""The extraction commands: extract, info, gc, verify, migrate, datasets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import UserError, not_a_file
from .app import Table, emit, err, out, path_of, progress_bar


def extract(
    dataset: str = typer.Option("offline-digits", help="dataset name (see `featcache datasets`)"),
    backbone: list[str] = typer.Option(
        ["efficientnet_lite0"], help="timm name, NAME=CHECKPOINT or NAME=random; repeat for several"
    ),
    partition: str = typer.Option("feature", help="feature | label | feature-label | pathological | iid"),
    clients: Optional[str] = typer.Option(
        None, help="number of clients (default: one per domain / 5); a comma list (5,10,20) writes one cache per value"
    ),
    alpha: str = typer.Option("0.5", help="Dirichlet concentration for label skew; a comma list sweeps"),
    per_class: Optional[str] = typer.Option(
        None, help="train images per class per client (FedPCL: 10); a comma list sweeps"
    ),
    test_per_class: Optional[int] = typer.Option(None, help="test images per class per client (FedPCL: 200)"),
    classes_per_client: int = typer.Option(2, help="classes per client for the pathological partition"),
    domains: Optional[list[str]] = typer.Option(
        None,
        "--domains",
        help="use only these domains (repeat); the one-domain partitions (label, pathological, iid) take one",
    ),
    val_fraction: float = typer.Option(0.2, help="share of train held out for validation (grid search)"),
    order: str = typer.Option(
        "shuffled",
        help="which images of a class a client takes: shuffled (seeded) | first "
        "(the dataset's order, FedPCL's first 10 per class)",
    ),
    test_split: Optional[str] = typer.Option(
        None,
        help="a client's test images: whole (each domain's whole test split, FedBN's and FedPCL's; the feature "
        "partition's default) | train-mix (its train label mix; the other partitions' default); printed",
    ),
    percent: Optional[float] = typer.Option(
        None, help="FedBN's --percent: the share of each domain's train split clients draw from (digit5: its parts)"
    ),
    holdout_domain: Optional[str] = typer.Option(
        None,
        help="leave-one-domain-out: clients train on the other domains and are all tested on this one, whole "
        "(feature, feature-label); a comma list writes one cache per held-out domain",
    ),
    image_size: Optional[int] = typer.Option(
        None, help="input size in pixels (default: 64 for images under 64 px, else each backbone's own; printed)"
    ),
    views: int = typer.Option(0, help="augmented views per training image (FedPCL two-crop, FedPFT+Con)"),
    noise: Optional[str] = typer.Option(None, help="image noise: laplace or gaussian (FedPCL A.2.4)"),
    noise_scale: float = typer.Option(0.2, help="noise scale s"),
    noise_p: float = typer.Option(0.1, help="perturbation coefficient p: x~ = (1-p) x + e"),
    seed: int = typer.Option(0, help="seed of partition, views and noise"),
    data_root: Optional[Path] = typer.Option(None, parser=path_of("--data-root"), help="folder holding the dataset"),
    download: bool = typer.Option(False, help="let torchvision datasets download (online users)"),
    out_dir: Path = typer.Option(Path("cache"), "--out", parser=path_of("--out"), help="folder for caches"),
    store: Optional[Path] = typer.Option(
        None,
        parser=path_of("--store"),
        help="folder of the embedding stores (default: OUT/store); share one between projects or machines",
    ),
    batch_size: Optional[int] = typer.Option(
        None,
        help="images decoded per step (default: 256 on CUDA, 64 on CPU); "
        "every forward holds 256 / 64 rows, so no byte depends on it",
    ),
    workers: Optional[int] = typer.Option(
        None, help="input worker processes (default: 0 for in-memory arrays, else one per core)"
    ),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    backend: str = typer.Option("local", help="local (this process) | ray (RAY_ADDRESS or a local Ray)"),
    allow_partial: bool = typer.Option(False, help="load checkpoints whose keys do not all match (rest: random)"),
    threads: Optional[int] = typer.Option(
        None, min=1, help="CPU threads of the forward passes (default: one fewer than the cores)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run each frozen backbone once over every client's images and write the embeddings to an HDF5 cache."""
    arguments = {k: v for k, v in locals().items() if k not in ("noise_scale", "noise_p", "out_dir", "as_json")}
    from ..extraction.plan import Noise, extract as run  # lazy: `featcache --help` loads no torch

    arguments |= {"noise": Noise(noise, noise_scale, noise_p) if noise else None, "out": out_dir}  # the API's forms
    note = lambda line: err.print(f"[yellow]note:[/yellow] {escape(line)}", highlight=False, soft_wrap=True)
    with progress_bar(not as_json) as progress:
        result = run(**arguments, progress=progress, note=note)  # comma lists: read as the command line writes them
    emit(result, as_json, _extract_table(result))


def _extract_table(result: dict) -> Table:
    """`extract`'s summary: each cache (a sweep's told apart by the values they differ in), what was embedded, where
    the seconds went."""
    table = Table(title="featcache extract")
    caches = result.get("caches", [result])
    swept = [k for k in caches[0]["partition"] if len({str(c["partition"][k]) for c in caches}) > 1]
    for r in caches:  # alpha=0.1 clients=10
        what = "".join(f", {k}={r['partition'][k]}" for k in swept)
        table.add_row("cache", f"{r['cache']} ({'hit' if r['cache_hit'] else 'written'}, {r['images']} images{what})")
    table.add_row("backbones", ", ".join(result.get("backbones") or result["caches"][0]["backbones"]))
    table.add_row("embedded", ", ".join(f"{k} {n} images" for k, n in result["embedded"].items()) or "nothing")
    table.add_row("seconds", str(result["seconds"]))
    if "phases" in result:  # a miss: where the seconds went
        table.add_row("phases", " · ".join(f"{k} {v:.1f} s" for k, v in result["phases"].items()))
    table.show_header = False
    return table


def info(
    cache: Path = typer.Argument(..., parser=path_of("CACHE"), help="cache file, store file or folder of stores"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Show a cache's metadata and per-client counts, or what a store (or a folder of them) holds."""
    from ..cache import info as read  # lazy: `featcache --help` loads no torch
    from ..extraction.stores import info as read_store, is_store  # lazy: `featcache --help` loads no torch

    if not cache.is_dir() and (why := not_a_file(cache)) is not None:  # a named pipe would hang the read
        raise UserError(f"{cache} {why}: pass a cache file, a store file or a folder of stores")
    if is_store(cache):
        _show_stores(read_store(cache), as_json)
        return
    meta = read(cache)
    if as_json:
        emit(meta, True)
        return
    head = Table(title=str(cache), show_header=False)
    for k in ("dataset", "backbones", "classes", "domains", "partition", "views", "images", "bytes", "created", "key"):
        head.add_row(k, json.dumps(meta.get(k)))
    for k, b in meta["backbone_info"].items():
        head.add_row(
            f"backbone {k}", f"{b['name']} dim={b['dim']} weights={b['weights']} sha256={b['weights_sha256'][:12]}"
        )
    out.print(head)
    counts = Table(title="clients")
    for col in ("client", "domain", "train", "val", "test"):
        counts.add_column(col)
    for c in meta["counts"]["clients"]:
        counts.add_row(*(str(c[col]) for col in ("client", "domain", "train", "val", "test")))
    out.print(counts)


def _show_stores(found: dict, as_json: bool) -> None:
    """One table per store: what it holds, what it was made from (dataset, root, image size, preprocessing,
    fingerprint), and why no command uses it or which other stores hold the same embeddings."""
    if as_json:
        emit(found, True)
        return
    out.print(
        f"{len(found['stores'])} store(s) in {escape(found['path'])}, {found['bytes'] / 2**20:.1f} MB", soft_wrap=True
    )
    for st in found["stores"]:
        table = Table(title=escape(Path(st["file"]).name), show_header=False, title_justify="left")
        if "problem" in st:
            table.add_row("[red]damaged[/red]", escape(st["problem"]))
            out.print(table)
            continue
        kind = {
            "legacy": " (identified by an older featcache: image files by path and modification time)",
            "recipe": " (built-in recipe: its code and packages)",
        }.get(st["identity"], " (content)")
        roots = [src.get("root", "?") + (f" -> {src['real']}" if src.get("real") else "") for src in st["sources"]]
        pre = st["preprocessing"]
        size = f"{st['image_size']} px" if st["image_size"] else "the backbone's own"
        size += f" (input {'x'.join(str(n) for n in pre['input_size'][1:])})" if pre.get("input_size") else ""
        rows = {
            "dataset": st["dataset"],
            "fingerprint": f"{str(st['fingerprint'])[:16]}{kind}",
            "root": "\n".join(roots) or "not recorded",
            "image size": size,
            "preprocessing": f"{pre.get('interpolation')}, mean {pre.get('mean')}, std {pre.get('std')}, "
            f"pipeline v{pre.get('pipeline')}",
            "backbone": f"{st['backbone']} ({st['weights']}"
            + (f", sha256 {st['weights_sha256'][:12]}" if st["weights_sha256"] else "")
            + f", dim {st['dim']})",
            "held": " · ".join(f"{k} {n}" for k, n in st["held"].items()) + f" ({st['images']} images, "
            f"{st['views']} views, {st['bytes'] / 2**20:.1f} MB)",
            "key": st["key"][:16],
        }
        for name, value in rows.items():
            table.add_row(name, escape(str(value)))
        if st["stale"]:
            table.add_row(
                "[yellow]unused[/yellow]",
                escape(
                    "made with " + "; ".join(st["stale"]) + ": no extraction "
                    "asks for its key again (`featcache gc` removes it)"
                ),
            )
        if st["duplicates"]:
            table.add_row(
                "[yellow]duplicate[/yellow]",
                escape(
                    "holds the same embeddings as "
                    + ", ".join(Path(f).name for f in st["duplicates"])
                    + " under another key"
                ),
            )
        out.print(table)
    for group in found["duplicates"]:
        err.print(
            f"[yellow]duplicates:[/yellow] {escape(', '.join(Path(f).name for f in group))} hold the same "
            "embeddings under different keys",
            highlight=False,
            soft_wrap=True,
        )


def gc(
    store: Path = typer.Argument(
        ..., parser=path_of("STORE"), help="folder of embedding stores (default of extract: CACHE/store)"
    ),
    dry_run: bool = typer.Option(False, help="say what would be removed or moved, change nothing"),
    remove_damaged: bool = typer.Option(
        False,
        help="remove damaged stores (and those moved aside earlier) instead of moving them into STORE/.quarantine",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check every store in a folder: move damaged ones aside, remove those made by other code or library versions
    and their leftover parts folders. Only what featcache made is touched; everything else is listed as left alone."""
    from ..extraction.stores import gc as collect  # lazy: `featcache --help` loads no torch

    report = collect(store, dry_run=dry_run, remove_damaged=remove_damaged)
    table = Table(title=f"featcache gc {store}" + (" (dry run)" if dry_run else ""), show_header=False)
    for entry in report["removed"]:
        table.add_row("would remove" if dry_run else "removed", escape(entry["file"]), escape(entry["reason"]))
    for entry in report["quarantined"]:
        table.add_row(
            "would move aside" if dry_run else "moved aside",
            escape(entry["file"]),
            escape(f"{entry['reason']} -> {entry['to']}"),
        )
    for entry in report["kept"]:
        table.add_row("kept", escape(entry["file"]), "checksums match")
    for entry in report["left_alone"]:
        table.add_row("left alone", escape(entry["file"]), escape(entry["reason"]))
    for group in report["duplicates"]:
        table.add_row(
            "duplicates",
            escape(", ".join(Path(f).name for f in group)),
            "the same embeddings under different keys: gc removes only those made by other code or versions",
        )
    emit(report, as_json, table)


def verify(
    cache: Path = typer.Argument(..., parser=path_of("CACHE"), help="cache file or store file"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check a cache (schema, counts, finite features, checksums) or a store (key, finite rows, checksums); report
    library versions that changed since."""
    from ..cache import verify as check  # lazy: `featcache --help` loads no torch
    from ..extraction.stores import is_store, verify as check_store

    report = check_store(cache) if cache.is_file() and is_store(cache) else check(cache)
    if as_json:
        emit(report, True)
    elif report["ok"]:
        out.print(f"ok: {cache} ({report['arrays']} arrays, checksums match, {report['seconds']} s)", soft_wrap=True)
    for line in report["stale"]:
        err.print(f"[yellow]warning:[/yellow] extracted with {line}", highlight=False, soft_wrap=True)
    if not report["ok"]:
        first = report["problems"][0]
        more = f" (+{len(report['problems']) - 1} more, see --json)" if len(report["problems"]) > 1 else ""
        raise UserError(f"{first}{more}" if str(cache) in first else f"{cache}: {first}{more}")


def migrate(
    cache: Path = typer.Argument(..., parser=path_of("CACHE"), help="cache file of an older format"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Convert a cache of an older format to the current one, in place (its feature bytes are kept and checked)."""
    from ..cache import migrate as convert  # lazy: `featcache --help` loads no torch

    report = convert(cache)
    if as_json:
        emit(report, True)
    else:
        out.print(
            f"migrated: {cache} (format {report['from_format']} -> {report['to_format']}, "
            f"{report['bytes_before']} -> {report['bytes']} bytes)",
            soft_wrap=True,
        )


def datasets(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List the dataset readers and the layout each expects."""
    from ..extraction.datasets import list_datasets  # lazy: `featcache --help` loads no numpy

    if as_json:
        emit({"datasets": dict(sorted(list_datasets().items()))}, True)
        return
    table = Table("dataset", "expected layout")
    for name, layout in sorted(list_datasets().items()):
        table.add_row(name, layout)
    out.print(table)

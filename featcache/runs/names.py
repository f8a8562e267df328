"""Readable run names: `fedprox-mu1-lr0.01-seed0-2-c2bce7fc7341` says what a run trains, the content hash after it
keeps names unique. The name lists the algorithm, the settings that differ from its defaults (its own settings
first, then the engine's), the cache's partition values that `extract` sweeps when not its defaults (`clients10`,
`alpha0.1`, `per_class20`, `holdout-sketch`: a sweep's runs in one folder say their cache), a subset of backbones
when one was chosen, and the seeds; it is a pure function of what the run trains, so the same command writes the
same name."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..extraction.partition.spec import DIRICHLET, PartitionSpec
from ..training.config import ENGINE_SETTINGS, defaults

MAX_LABEL = 100  # characters before the hash; a longer description is cut (the hash still tells runs apart)


def _value(v) -> str:
    """A setting's value as a file-name word: 0.01, 1 (for 1.0), 1e-05, true, adam."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        v = f"{v:g}"
    return re.sub(r"[^A-Za-z0-9.+-]", "_", str(v))


def seeds_word(seeds: Sequence[int]) -> str:
    """`seed0-2` for 0,1,2 (a run of consecutive seeds), `seed0_3_7` otherwise, `seed4` for one."""
    s = [int(x) for x in seeds]
    if len(s) > 2 and s == list(range(s[0], s[0] + len(s))):
        return f"seed{s[0]}-{s[-1]}"
    return "seed" + "_".join(map(str, s))


def cache_words(partition: dict | None) -> list[str]:
    """The partition values `extract` sweeps (clients, alpha for a Dirichlet scheme, per_class, holdout_domain)
    that differ from its defaults, as name words: `clients10`, `alpha0.1`, `per_class20`, `holdout-sketch`."""
    p, base = partition or {}, PartitionSpec()
    words = [f"clients{p['clients']}"] if p.get("clients") is not None else []
    if p.get("scheme") in DIRICHLET and p.get("alpha", base.alpha) != base.alpha:
        words.append(f"alpha{_value(p['alpha'])}")
    words += [f"per_class{p['per_class']}"] if p.get("per_class") is not None else []
    return words + ([f"holdout-{_value(p['holdout_domain'])}"] if p.get("holdout_domain") else [])


def run_name(
    algo, cfg: dict, seeds: Sequence[int], backbones: Sequence[str] | None, run_id: str, partition: dict | None = None
) -> str:
    """`algo-<settings that differ from its defaults>-<cache words>-[backbones]-seedS-<run_id>`; `algo` is the bound
    algorithm (its registered name and declared defaults), `cfg` its resolved settings, `partition` the cache's
    (`cache_words`)."""
    base = defaults(algo)
    order = [k for k in base if k not in ENGINE_SETTINGS] + [k for k in ENGINE_SETTINGS if k in base]
    words = [f"{k}{_value(cfg[k])}" for k in order if k != "seed" and k in cfg and cfg[k] != base[k]]
    words += cache_words(partition)
    if backbones:
        words.append("+".join(_value(b) for b in backbones))
    label = "-".join([algo.name, *words, seeds_word(seeds)])
    return f"{label[:MAX_LABEL].rstrip('-')}-{run_id}"

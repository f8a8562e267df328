"""Run configurations are data: engine defaults + the algorithm's defaults + strict `key=value` overrides.

Every setting has a type (that of its default) and, where it has one, a valid range declared once here in `RANGES`,
keyed by setting name: the engine's settings and the settings algorithms share by name (mu, tau, proj_dim, ...).
`resolve` checks one configuration; `check` checks an already resolved one, so a grid checks every configuration (all
values of every axis) before anything trains. A float setting must also be finite, and an integer one below 2^31.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine import ENGINE_DEFAULTS
from ..errors import UserError, suggest

_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
MAX_INT = 2**31 - 1  # an integer setting above this is a typo (and overflows the engine's index arithmetic)
MAX_SEED = 2**32 - 1  # seeds seed torch.Generators and the engine's int64 hash


@dataclass(frozen=True)
class Range:
    """lo / hi bounds (None: unbounded), each inclusive or not; `why` is added to the message."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def holds(self, v) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def text(self) -> str:
        lo = "" if self.lo is None else f"{self.lo:g} {'<' if self.lo_open else '<='} "
        hi = "" if self.hi is None else f" {'<' if self.hi_open else '<='} {self.hi:g}"
        return f"{lo}x{hi}" if lo and hi else (f"x {'>' if self.lo_open else '>='} {self.lo:g}" if lo else f"x{hi}")


AT_LEAST_1 = Range(1)
POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1, hi_open=True)  # [0, 1)

# Valid ranges by setting name. A name not listed has only its type checked (and finiteness for floats).
RANGES: dict[str, Range] = {
    # engine
    "rounds": AT_LEAST_1, "local_epochs": AT_LEAST_1, "batch_size": AT_LEAST_1, "eval_every": AT_LEAST_1,
    "lr": POSITIVE, "weight_decay": NON_NEGATIVE, "momentum": FRACTION,
    "participation": Range(0, 1, lo_open=True, why="the share of clients per round"),
    # widths and counts shared by algorithms
    "proj_dim": AT_LEAST_1, "con_dim": AT_LEAST_1, "heads": AT_LEAST_1, "n_prompts": AT_LEAST_1, "queue": AT_LEAST_1,
    "inner_steps": AT_LEAST_1, "head_epochs": NON_NEGATIVE, "r_f": NON_NEGATIVE, "r_a": NON_NEGATIVE,
    # regularisation weights, temperatures, rates
    "mu": NON_NEGATIVE, "lam": NON_NEGATIVE, "tau": POSITIVE, "beta": POSITIVE, "sigma": POSITIVE,
    "alpha": POSITIVE, "alpha_k": POSITIVE, "personal_lr": POSITIVE, "ftm_lr_scale": NON_NEGATIVE,
    "moco_m": Range(0, 1), "self_attention": Range(0, 1), "proto_noise_scale": NON_NEGATIVE,
    "proto_noise_p": FRACTION,
}


def parse_value(key: str, text: str, default):
    """Cast `text` to the type of `default` (bool, int, float, str); a wrong type is a one-line error."""
    try:
        if isinstance(default, bool):
            return _BOOL[str(text).lower()]
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        return str(text)
    except (ValueError, KeyError, OverflowError):
        raise UserError(f"--set {key}={text}: expected a {type(default).__name__} like {default!r}") from None


def _cast(key: str, value, default):
    """A non-string override (the Python API) converted to the default's type, strictly."""
    if isinstance(value, str):
        return parse_value(key, value, default)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    else:
        return str(value)
    raise UserError(f"--set {key}={value!r}: expected a {type(default).__name__} like {default!r}")


def pairs(overrides: list[str] | tuple, flag: str = "--set") -> dict[str, str]:
    """['lr=0.1', 'mu=1'] -> {'lr': '0.1', 'mu': '1'}; a key given twice is refused (which one would win?)."""
    out: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise UserError(f"{flag} {item!r}: write key=value, e.g. {flag} lr=0.01")
        k, v = item.split("=", 1)
        k = k.strip()
        if k in out:
            raise UserError(f"{flag} {k} is given twice ({k}={out[k]} and {k}={v.strip()}): give it once")
        out[k] = v.strip()
    return out


def resolve(algo, overrides: dict | list[str] | None = None) -> dict:
    """The fully resolved and checked configuration of one run. Overrides are a dict or `key=value` strings."""
    cfg = ENGINE_DEFAULTS | algo.defaults
    if isinstance(overrides, (list, tuple)):
        overrides = pairs(overrides)
    for k, v in (overrides or {}).items():
        if k == "seed":
            raise UserError("seed is not a setting: pass --seeds 0,1,2")
        if k not in cfg:
            raise UserError(f"unknown setting {k!r} for {algo.name}{suggest(k, cfg)}; known: {', '.join(sorted(cfg))}")
        cfg[k] = _cast(k, v, cfg[k])
    check(algo, cfg)
    return cfg


def check(algo, cfg: dict) -> None:
    """Refuse a resolved configuration with a value outside its type's or its setting's range, in one line."""
    if cfg["optimizer"] not in ("adam", "sgd"):
        got = cfg["optimizer"]
        raise UserError(f"optimizer must be adam or sgd (got {got!r}){suggest(str(got), ('adam', 'sgd'))}")
    for k, v in cfg.items():
        if k == "seed" or isinstance(v, (bool, str)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{algo.name}: {k}={v} is not a finite number: fix --set {k}=...")
        if isinstance(v, int) and abs(v) > MAX_INT:
            raise UserError(f"{algo.name}: {k}={v} is too large (at most {MAX_INT}): fix --set {k}=...")
        rng = RANGES.get(k)
        if rng is not None and not rng.holds(v):
            why = f" ({rng.why})" if rng.why else ""
            raise UserError(f"{algo.name}: {k}={v!r} out of range: {k} must satisfy {rng.text().replace('x', k, 1)}"
                            f"{why}: fix --set {k}=...")
    for k, allowed in getattr(algo, "choices", {}).items():
        if cfg[k] not in allowed:
            raise UserError(f"{algo.name}: {k} must be one of {', '.join(allowed)} (got {cfg[k]!r})"
                            f"{suggest(str(cfg[k]), allowed)}: fix --set {k}=...")


def check_clients(cfg: dict, clients: int) -> None:
    """Participation must pick at least one of `clients` clients per round (the engine would round it up silently)."""
    p = cfg["participation"]
    if p < 1 and round(p * clients) < 1:
        raise UserError(f"participation={p:g} selects no client of {clients} per round: use participation >= "
                        f"{0.5 / clients:g} (one client) or 1.0 (all)")


def check_seeds(seeds) -> list[int]:
    """Seeds as ints in 0..2^32-1, at least one, none twice (a repeated seed would make mean(std) lie)."""
    seeds = list(seeds)
    if not seeds:
        raise UserError("--seeds needs at least one seed, e.g. --seeds 0,1,2")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED:
            raise UserError(f"--seeds: seed {s} is out of range: seeds are integers 0..{MAX_SEED}")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise UserError(f"--seeds lists seed {twice[0]} twice: each seed once (mean(std) is over distinct seeds)")
    return [int(s) for s in seeds]


def merge_rounds(overrides: list[str] | dict | None, rounds: int | None) -> list[str] | dict:
    """`--rounds N` added to the --set overrides; refused when --set rounds=... is given too."""
    overrides = dict(overrides) if isinstance(overrides, dict) else list(overrides or [])
    if rounds is None:
        return overrides
    given = overrides if isinstance(overrides, dict) else pairs(overrides)
    if "rounds" in given:
        raise UserError(f"--rounds {rounds} and --set rounds={given['rounds']} both given: pass only one")
    return overrides | {"rounds": rounds} if isinstance(overrides, dict) else overrides + [f"rounds={rounds}"]

"""Run configurations are data: engine defaults + the algorithm's defaults + strict `key=value` overrides."""

from __future__ import annotations

from .engine import ENGINE_DEFAULTS
from .errors import UserError, suggest

_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


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
    except (ValueError, KeyError):
        raise UserError(f"--set {key}={text}: expected a {type(default).__name__} like {default!r}") from None


def resolve(algo, overrides: dict | list[str] | None = None) -> dict:
    """The fully resolved configuration of one run. Overrides are a dict or `key=value` strings."""
    cfg = ENGINE_DEFAULTS | algo.defaults
    if isinstance(overrides, (list, tuple)):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise UserError(f"--set {item!r}: write key=value, e.g. --set lr=0.01")
            k, v = item.split("=", 1)
            pairs[k.strip()] = v.strip()
        overrides = pairs
    for k, v in (overrides or {}).items():
        if k == "seed":
            raise UserError("seed is not a setting: pass --seeds 0,1,2")
        if k not in cfg:
            raise UserError(f"unknown setting {k!r} for {algo.name}{suggest(k, cfg)}; known: {', '.join(sorted(cfg))}")
        cfg[k] = parse_value(k, v, cfg[k]) if isinstance(v, str) else type(cfg[k])(v)
    if cfg["optimizer"] not in ("adam", "sgd"):
        raise UserError(f"optimizer must be adam or sgd (got {cfg['optimizer']!r})")
    positive = [k for k in ("rounds", "local_epochs", "batch_size", "eval_every", "proj_dim") if cfg.get(k, 1) < 1]
    if positive or not 0 < cfg["participation"] <= 1:
        raise UserError(f"{', '.join(positive) or 'participation'} out of range: rounds, local_epochs, batch_size, "
                        "eval_every, proj_dim must be >= 1 and 0 < participation <= 1")
    for k, allowed in getattr(algo, "choices", {}).items():
        if cfg[k] not in allowed:
            raise UserError(f"{algo.name}: {k} must be one of {', '.join(allowed)} (got {cfg[k]!r})"
                            f"{suggest(str(cfg[k]), allowed)}: fix --set {k}=...")
    return cfg

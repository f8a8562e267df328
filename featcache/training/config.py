"""Run configurations are data: each setting is declared once, as a `Setting`, by its owner (the engine's here in
`ENGINE_SETTINGS`, an algorithm's in its class's `settings`), and resolved with strict `key=value` overrides.

A declaration gives the default (whose type is the setting's type), the valid range or choices, a one-line help and
whether a grid may batch its values. An algorithm's table is the engine's, then each class's `settings` along its
MRO from FedAvg down: a class declares only what it adds or changes (a bare value changes the inherited default, None
removes a setting its model does not have). `resolve` checks one configuration; `check` an already resolved one, so a
grid checks every configuration (all values of every axis) before anything trains. A float setting must also be
finite, and an integer one below 2^31.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import cast

from ..errors import UserError, as_list, comma_values, suggest

_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
MAX_INT = 2**31 - 1  # an integer setting above this is a typo (and overflows the engine's index arithmetic)
MAX_SEED = 2**32 - 1  # seeds seed torch.Generators and the engine's int64 hash


@dataclass(frozen=True)
class Setting:
    """One setting: its default (and so its type: bool, int, float or str), the valid range (lo / hi, None for
    unbounded, each end closed unless `lo_open` / `hi_open`) or `choices`, a one-line `help`, and `batched`: whether
    one batched run may hold a different value per configuration (a float tensor [H] on the configuration axis).
    `batched=False` marks a float the run reads once (a shape, a per-run schedule); ints, bools and strings never
    batch (a grid over them runs one bucket per value)."""

    default: bool | int | float | str
    help: str = ""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()
    batched: bool = True

    def __post_init__(self):
        if not isinstance(self.default, float):
            object.__setattr__(self, "batched", False)
        object.__setattr__(self, "choices", tuple(self.choices))

    @property
    def type(self) -> type:
        return type(self.default)

    def holds(self, v) -> bool:
        """Whether `v` (already of this setting's type) is inside the range and among the choices."""
        if self.choices:
            return v in self.choices
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def range_text(self, name: str = "x") -> str:
        """'0 <= tau <= 1', 'lr > 0', 'one of adam, sgd'; '' when any value of the type is valid."""
        if self.choices:
            return f"one of {', '.join(map(str, self.choices))}"
        lo = "" if self.lo is None else f"{self.lo:g} {'<' if self.lo_open else '<='} "
        hi = "" if self.hi is None else f" {'<' if self.hi_open else '<='} {self.hi:g}"
        if lo and hi:
            return f"{lo}{name}{hi}"
        if lo:
            return f"{name} {'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{name}{hi}" if hi else ""


ENGINE_SETTINGS: dict[str, Setting] = {
    "rounds": Setting(50, "communication rounds", lo=1),
    "local_epochs": Setting(1, "local epochs per round", lo=1),
    "batch_size": Setting(32, "rows per local minibatch", lo=1),
    "drop_last": Setting(
        True,
        "drop each client's last partial minibatch of an epoch, unless it is the client's only one: a client with "
        "fewer rows than batch_size (a Dirichlet sweep's smallest) trains on all of them in one step, never on none",
    ),
    "optimizer": Setting("adam", "the local optimizer", choices=("adam", "sgd")),
    "lr": Setting(1e-3, "local learning rate", lo=0, lo_open=True),
    "weight_decay": Setting(1e-4, "L2 weight decay added to the gradient", lo=0),
    "momentum": Setting(0.9, "SGD momentum (Adam ignores it)", lo=0, hi=1, hi_open=True),
    "participation": Setting(1.0, "the share of clients per round", lo=0, hi=1, lo_open=True, batched=False),
    "eval_every": Setting(1, "evaluate every this many rounds (and after the last)", lo=1),
    "seed": Setting(0, "set by --seeds, not --set", lo=0, hi=MAX_SEED),
}


def settings_of(algo) -> MappingProxyType:
    """The full, ordered table of an algorithm's settings (a class or an instance): the engine's, then each class's
    `settings` along the MRO, base first. A bare value changes an inherited default (same type); None removes one."""
    cls = algo if isinstance(algo, type) else type(algo)
    table = dict(ENGINE_SETTINGS)
    for klass in reversed(cls.__mro__):
        for k, s in klass.__dict__.get("settings", {}).items():
            where = f"{klass.__qualname__}.settings[{k!r}]"
            if s is None:
                table.pop(k, None)
            elif isinstance(s, Setting):
                if k in table and s.type is not table[k].type:
                    raise UserError(
                        f"{where} = Setting({s.default!r}, ...): {k} is a {table[k].type.__name__}: "
                        f"give a default like {table[k].default!r}"
                    )
                table[k] = s
            elif k not in table:
                raise UserError(f"{where} = {s!r}: a new setting needs a declaration, Setting({s!r}, help=...)")
            elif type(s) is not table[k].type:
                raise UserError(
                    f"{where} = {s!r}: {k} is a {table[k].type.__name__}: give a default like {table[k].default!r}"
                )
            else:
                table[k] = replace(table[k], default=cast(bool | int | float | str, s))  # of the setting's type
    for k, s in table.items():
        if k != "seed" and not s.holds(s.default):
            raise UserError(
                f"{cls.__qualname__}: the default {k}={s.default!r} is outside its own range: {s.range_text(k)}"
            )
    return MappingProxyType(table)


def defaults(algo) -> dict:
    """Every setting of `algo` at its default, in declaration order (the engine's first)."""
    return {k: s.default for k, s in settings_of(algo).items()}


def describe(algo) -> dict[str, dict]:
    """Every --set setting of `algo` as plain data: default, type, range (or choices), batched, help."""
    out = {}
    for k, s in settings_of(algo).items():
        if k != "seed":
            out[k] = {
                "default": s.default,
                "type": s.type.__name__,
                "range": s.range_text(k),
                "batched": s.batched,
                "help": s.help,
            } | ({"choices": list(s.choices)} if s.choices else {})
    return out


def structural_keys(cfg: dict, algo) -> list[str]:
    """Settings that must be equal inside one batched run (shapes, options, per-run floats); every other float is a
    per-configuration tensor [H]. (The seed is not structural: it is a per-configuration value, `Round.seeds`.)"""
    table = settings_of(algo)
    return [k for k in cfg if k != "seed" and not table[k].batched]


def shared_settings(cfg: dict, algo) -> MappingProxyType:
    """The settings an algorithm is bound to: the structural ones, read-only (per-configuration floats are absent,
    so a hook cannot read configuration 0's value by mistake: they are tensors in `Round.hp`)."""
    return MappingProxyType({k: cfg[k] for k in structural_keys(cfg, algo)})


def batched(cfgs: list[dict], algo) -> tuple[MappingProxyType, dict[str, list[float]]]:
    """(shared settings, per-configuration floats name -> H values) of configurations run as one batch; refuses
    configurations that differ in a structural setting."""
    structural = structural_keys(cfgs[0], algo)
    for c in cfgs[1:]:
        diff = [k for k in structural if c[k] != cfgs[0][k]]
        if diff:
            raise UserError(f"configurations of one batched run must share {diff}: run them as separate buckets")
    floats = [k for k in cfgs[0] if k not in structural and k != "seed"]
    return shared_settings(cfgs[0], algo), {k: [float(c[k]) for c in cfgs] for k in floats}


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


def pairs(overrides: list[str] | tuple | str, flag: str = "--set") -> dict[str, str]:
    """['lr=0.1', 'mu=1'] -> {'lr': '0.1', 'mu': '1'} (a lone 'lr=0.1' is one override); a key given twice is
    refused (which one would win?)."""
    out: dict[str, str] = {}
    for item in as_list(overrides, flag) or []:
        if "=" not in item:
            raise UserError(f"{flag} {item!r}: write key=value, e.g. {flag} lr=0.01")
        k, v = item.split("=", 1)
        k = k.strip()
        if not k:
            raise UserError(f"{flag} {item!r} has no key before '=': write key=value, e.g. {flag} lr=0.01")
        if k in out:
            raise UserError(f"{flag} {k} is given twice ({k}={out[k]} and {k}={v.strip()}): give it once")
        out[k] = v.strip()
    return out


def scoped(overrides: dict | list[str] | None, algos: list, flag: str = "--set") -> dict[str, dict]:
    """Each chosen algorithm's own overrides (name -> {setting: value}). `fedprox.mu=1` applies to fedprox alone and
    wins over a plain `mu=...` there; a plain setting applies to every algorithm, so one that only some of them have
    is refused with the scoped spelling, and a scope that names no chosen algorithm is refused."""
    if isinstance(overrides, (list, tuple, str)):
        overrides = pairs(overrides, flag)
    names = [a.name for a in algos]
    tables = {a.name: settings_of(a) for a in algos}
    plain: dict = {}
    own: dict[str, dict] = {n: {} for n in names}
    for key, value in (overrides or {}).items():
        where, dot, k = str(key).rpartition(".")
        if dot and (not where.strip() or not k.strip()):
            empty = "algorithm name before" if not where.strip() else "setting name after"
            raise UserError(
                f"{flag} {key}={value}: the {empty} the '.' is empty: write ALGO.key=value (e.g. "
                "fedprox.mu=1) or key=value"
            )
        if not dot:
            plain[k] = value
        elif where in own:
            own[where][k] = value
        elif (algo := next((n for n in names if str(key).startswith(f"{n}.")), None)) is not None:
            rest = str(key)[len(algo) + 1 :]  # `fedprox.mu.x`: no setting has a '.' in its name
            raise UserError(
                f"{flag} {key}: {algo} has no setting {rest!r}{suggest(rest, tables[algo])}: write "
                f"{algo}.KEY=value with one of its settings (`featcache algos {algo}` lists them)"
            )
        elif len(names) == 1:
            raise UserError(
                f"{flag} {key}: {where} is not the algorithm of this run ({names[0]}): write {names[0]}.{k} or {k}"
            )
        else:
            raise UserError(
                f"{flag} {key}: {where} is not among the chosen algorithms{suggest(where, names)}; "
                f"chosen: {', '.join(names)}"
            )
    for k, value in plain.items():
        having = [n for n in names if k in tables[n]]
        if having and len(having) < len(names):
            raise UserError(
                f"{k} is a setting of {', '.join(having)} only: write {' '.join(f'{n}.{k}={value}' for n in having)}"
            )
    return {n: plain | own[n] for n in names}


def resolve(algo, overrides: dict | list[str] | None = None) -> dict:
    """The fully resolved and checked configuration of one run. Overrides are a dict or `key=value` strings; a key
    may be scoped by the algorithm's name (`fedprox.mu`, see `scoped`)."""
    cfg = defaults(algo)
    for k, v in scoped(overrides, [algo])[algo.name].items():
        if k == "seed":
            raise UserError("seed is not a setting: pass --seeds 0,1,2")
        if k not in cfg:
            raise UserError(f"unknown setting {k!r} for {algo.name}{suggest(k, cfg)}; known: {', '.join(sorted(cfg))}")
        cfg[k] = _cast(k, v, cfg[k])
    check(algo, cfg)
    return cfg


def check(algo, cfg: dict) -> None:
    """Refuse a resolved configuration with a value outside its type's or its declared range or choices, in one
    line."""
    table = settings_of(algo)
    for k, v in cfg.items():
        s = table[k]
        if k == "seed":
            continue
        if s.choices and v not in s.choices:
            raise UserError(
                f"{algo.name}: {k} must be one of {', '.join(map(str, s.choices))} (got {v!r})"
                f"{suggest(str(v), s.choices)}: fix --set {k}=..."
            )
        if isinstance(v, (bool, str)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{algo.name}: {k}={v} is not a finite number: fix --set {k}=...")
        if isinstance(v, int) and abs(v) > MAX_INT:
            raise UserError(f"{algo.name}: {k}={v} is too large (at most {MAX_INT}): fix --set {k}=...")
        if not s.holds(v):
            why = f" ({s.help})" if s.help else ""
            raise UserError(
                f"{algo.name}: {k}={v!r} out of range: {k} must satisfy {s.range_text(k)}{why}: fix --set {k}=..."
            )


def check_clients(cfg: dict, clients: int) -> None:
    """Participation must pick at least one of `clients` clients per round (the engine would round it up silently)."""
    p = cfg["participation"]
    if p < 1 and round(p * clients) < 1:
        raise UserError(
            f"participation={p:g} selects no client of {clients} per round: use participation >= "
            f"{0.5 / clients:g} (one client) or 1.0 (all)"
        )


def check_seeds(seeds) -> list[int]:
    """Seeds as ints in 0..2^32-1 (one int: one seed), at least one, none twice (a repeated seed would make mean(std)
    lie)."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):  # one seed
        seeds = [seeds]
    seeds = comma_values(seeds, int, "--seeds")  # the command line's "0,1,2"
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__iter__"):
        raise UserError(f"--seeds must be a list of integers such as [0, 1, 2] (got {seeds!r})")
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
    overrides = dict(overrides) if isinstance(overrides, dict) else as_list(overrides, "--set") or []
    if rounds is None:
        return overrides
    given = overrides if isinstance(overrides, dict) else pairs(overrides)
    for k, v in given.items():
        if str(k).rpartition(".")[2] == "rounds":
            raise UserError(f"--rounds {rounds} and --set {k}={v} both given: pass only one")
    return overrides | {"rounds": rounds} if isinstance(overrides, dict) else overrides + [f"rounds={rounds}"]

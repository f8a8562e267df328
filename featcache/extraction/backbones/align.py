"""Renaming one state dict onto another's keys, with the correspondence proved by block structure, layer kind,
parameter and shape rather than trusted from the order."""

from __future__ import annotations

import itertools
import re


def align_state_dicts(source: dict, target: dict) -> dict:
    """Rename `source` tensors to `target`'s keys, proving the correspondence rather than trusting the order.

    Both state dicts are cut into runs of consecutive keys of one block (`_blocks.I.` / `blocks.S.J.`) or of the
    stem/head between blocks. The runs must have the same lengths, and each pair of tensors the same layer kind (conv,
    bn, linear), the same parameter (weight, bias, running_mean, ...) and the same shape. Raises RuntimeError else.
    """
    source_runs, target_runs = _runs(source), _runs(target)
    if [len(run) for run in source_runs] != [len(run) for run in target_runs]:
        raise RuntimeError(
            f"state dicts differ in block structure: tensors per block {[len(r) for r in source_runs]} "
            f"vs {[len(r) for r in target_runs]}"
        )
    mapping = dict(zip(itertools.chain(*source_runs), itertools.chain(*target_runs)))
    for s, t in mapping.items():
        if _role(s) != _role(t) or source[s].shape != target[t].shape:
            raise RuntimeError(f"{s} {tuple(source[s].shape)} does not correspond to {t} {tuple(target[t].shape)}")
    return {t: source[s] for s, t in mapping.items()}


def _runs(state: dict) -> list[list[str]]:
    """Keys in order, grouped into runs that share a block prefix (or lie outside the blocks)."""

    def block(key: str) -> str:
        found = re.match(r"_?blocks\.\d+(?:\.\d+)?\.", key)
        return found.group(0) if found else ""

    return [list(run) for _, run in itertools.groupby(state, key=block)]


def _role(key: str) -> tuple[str, str]:
    """('conv' | 'bn' | 'linear', parameter name) of a state-dict key."""
    module, _, param = key.rpartition(".")
    layer = module.rsplit(".", 1)[-1]
    kind = "conv" if "conv" in layer else "bn" if "bn" in layer else "linear"
    return kind, param

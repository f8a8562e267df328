"""Per-configuration floats of a batched run (learning rate, weight decay, μ, τ, ...), in the one form that the
optimizer and every hook read: name -> [H] float32 on the run's device, with the same values on the host."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class HParams(Mapping):
    """A read-only mapping name -> [H] float32 on the device (`rnd.hp[name]`); `host[name]` holds the H values as
    Python floats, taken once from the configurations (the fused optimizers step one configuration at a time)."""

    tensors: MappingProxyType  # name -> [H] float32 on the device
    host: MappingProxyType  # name -> tuple of H floats

    @classmethod
    def of(cls, values: Mapping, device: str | torch.device = "cpu") -> HParams:
        """From name -> H values (a list of floats or a tensor [H])."""
        host = {k: tuple(v.tolist() if torch.is_tensor(v) else map(float, v)) for k, v in values.items()}
        tensors = {k: torch.as_tensor(v, dtype=torch.float32).to(device) for k, v in values.items()}  # [H] each
        return cls(MappingProxyType(tensors), MappingProxyType(host))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

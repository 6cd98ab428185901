"""A CUDA parameter as the adapters' ``weights_bytes`` reads it: only its storage's address and size."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class Tensor:
    """A parameter on the device; storages shared by two parameters (a tied embedding) have one address."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.is_cuda, self._storage = True, SimpleNamespace(data_ptr=lambda: address, nbytes=lambda: nbytes)

    def untyped_storage(self) -> Any:
        return self._storage

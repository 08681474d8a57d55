"""The base of every kernel configuration: a frozen dataclass, one per kernel family.

A configuration is passed to a kernel entry point as an argument (`config=...`); there are no
environment switches. `replace` rejects unknown fields, so a misspelled tile name is an error
instead of a silent no-op. Through `torch.library` custom ops a configuration travels as its
`key()` string (custom-op schemas take no Python objects) and is rebuilt with `from_key`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import TypeVar

from ..errors import XLSTMKitError

C = TypeVar("C", bound="KernelConfig")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    def replace(self: C, **changes) -> C:
        """A copy with `changes` applied; unknown field names raise ValueError."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise XLSTMKitError(f"{type(self).__name__} has no field {', '.join(unknown)}; "
                             f"its fields are {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)

    def key(self) -> str:
        """A string that `from_key` turns back into an equal configuration."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_key(cls: type[C], key: str) -> C:
        return _from_key(cls, key)


@functools.lru_cache(maxsize=256)
def _from_key(cls, key: str):
    return cls(**json.loads(key))

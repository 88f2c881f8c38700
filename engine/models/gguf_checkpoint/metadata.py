"""A GGUF file's key/value metadata (reader.py decodes it), remembering which keys were consulted.

The architecture's keys (`{architecture}.*`) a file sets but no table here reads are refused: an
unread key is a setting the engine would silently ignore (a soft-cap, an extra rope factor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class GGUFError(ValueError):
    """A GGUF file this engine cannot run; the message is one line naming the file and the reason."""


class Metadata:
    def __init__(self, path: Path, fields: dict[str, Any]) -> None:
        self.path = path
        self._fields = fields
        self._read: set[str] = set()
        self.architecture: str = self.get("general.architecture", "")

    def get(self, name: str, default: Any = None) -> Any:
        self._read.add(name)
        return self._fields.get(name, default)

    def has(self, name: str) -> bool:
        return name in self._fields

    def arch(self, name: str, default: Any = None) -> Any:
        """`{architecture}.{name}`; raises naming the key when it is missing and has no default."""
        value = self.get(f"{self.architecture}.{name}", default)
        if value is None:
            raise self.error(f"metadata {self.architecture}.{name} is missing")
        return value

    def unread_architecture_keys(self) -> list[str]:
        prefix = f"{self.architecture}."
        return sorted(name for name in self._fields if name.startswith(prefix) and name not in self._read)

    def error(self, reason: str) -> GGUFError:
        return GGUFError(f"{self.path}: {reason}")

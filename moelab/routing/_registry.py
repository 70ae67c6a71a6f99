"""The small registry every routing stage keeps: variant classes by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Variant classes of one stage kind, keyed by their ``name`` class attribute (the
    value of the config key that chooses them)."""

    def __init__(self, kind: str, validate: Callable[[T], None] | None = None) -> None:
        self.kind = kind
        self._validate = validate
        self._classes: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Add ``cls`` under ``cls.name`` (usable as a class decorator); a name taken by
        another class is refused."""
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{cls.__name__} needs a class attribute name (its config value)")
        if self._validate is not None:
            self._validate(cls)
        if self._classes.get(name, cls) is not cls:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a variant (for tests that register a toy one)."""
        self._classes.pop(name, None)

    def available(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._classes)

    def get(self, name: str) -> T:
        """The class registered under ``name``."""
        try:
            return self._classes[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"{self.kind} must be one of {self.available()}, got {name!r}"
            ) from None

    def classes(self) -> tuple[T, ...]:
        """The registered classes, in registration order."""
        return tuple(self._classes.values())

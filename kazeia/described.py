"""Options dataclasses whose fields carry a one-line description, for the front ends.

A field made with `option(default, help)` is documented once, where it is declared: the `kazeia`
command makes its flag from it (one flag per field, its help line that description), the server its
request field. `Described.describe()` lists them. Non-goals: what any option means (its own class).
"""

from __future__ import annotations

from dataclasses import field, fields


def option(default, help: str, flag: type | None = None):
    """A field with its one-line description. `flag`: the type a command-line value is read as
    (default: the type of `default`)."""
    return field(default=default, metadata={"help": help, "flag": flag if flag is not None else type(default)})


class Described:
    """Options whose fields are made with `option`: their names and descriptions, for front ends."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    @classmethod
    def describe(cls) -> dict[str, tuple[type, str]]:
        """name -> (the type a command-line value is read as, one-line description)."""
        return {f.name: (f.metadata["flag"], f.metadata["help"]) for f in fields(cls)}  # type: ignore[arg-type]

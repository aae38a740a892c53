"""``str(result)`` of every result type: its summary, :meth:`Summarized.format`."""

from __future__ import annotations


class Summarized:
    """A result whose ``str()`` is its ``format()`` (the summary, not the fields). Listed before
    ``BaseModel`` among a class's bases, whose own ``__str__`` lists the fields."""

    def format(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.format()


__all__ = ["Summarized"]

"""``Lifecycle``: what the soak's processes and network pieces share, a ``with`` block that starts them and
always closes them, also when ``start`` fails halfway (``close`` must cope with a half-started object)."""
from __future__ import annotations

from abc import ABC, abstractmethod


class Lifecycle(ABC):
    @abstractmethod
    def start(self) -> None:
        """Bring it up; return once it can be used."""

    @abstractmethod
    def close(self) -> None:
        """Take down whatever exists of it; safe to call twice, or after a failed ``start``."""

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Context-manager plumbing shared by the test servers, the proxy and the HTTP session.

Each of them releases everything in ``close()``; these mixins make ``with`` call
it, so the five classes do not each spell out the same ``__exit__``.
"""

from __future__ import annotations

from types import TracebackType

from typing_extensions import Self


class ClosesOnExit:
    """``with obj:`` yields ``obj`` and calls ``obj.close()`` on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class StartsOnEnter(ClosesOnExit):
    """As :class:`ClosesOnExit`, but entering also starts the server."""

    def start(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

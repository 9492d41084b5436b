"""The shared parking tiers as one slot's generator sees them under ``--parallel``
(:class:`ExecutorParking`): each move of a conversation runs as one step on the engine
executor's thread (see :mod:`redlite.core.scheduler`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from redlite.core.executor import EngineExecutor
from redlite.core.live_state import SlotPrefix

if TYPE_CHECKING:
    from redlite.core.generation import Generator


class ExecutorParking:
    """The shared parking tiers as one slot's generator sees them: every method call runs on
    the executor thread as one step (one slot moves conversations at a time, and the engine
    calls inside run there directly, between decode batches); attributes are read as they
    are, and set on the tiers. The slot's next candidate step also considers the prefix
    :meth:`lend` offers."""

    def __init__(self, parking: Any, executor: EngineExecutor) -> None:
        object.__setattr__(self, "parking", parking)
        object.__setattr__(self, "executor", executor)
        object.__setattr__(self, "_offer", None)  # (SlotPrefix, called once the step is over)

    def lend(self, offer: SlotPrefix, returned: Callable[[], None]) -> None:
        """Offer ``offer`` to the slot's next candidate step; ``returned()`` is called once,
        when that step is over (or at :meth:`end_offer`)."""
        object.__setattr__(self, "_offer", (offer, returned))

    def end_offer(self) -> None:
        """Withdraw the offer, if any (its ``returned()`` is called)."""
        offer = self._offer
        object.__setattr__(self, "_offer", None)
        if offer is not None:
            offer[1]()

    def select(self, gen: "Generator", prompt: list[int], request_id: str = "req", session: str | None = None,
               notes: list | None = None) -> None:
        """:meth:`Conversations.select <redlite.core.conversations.Conversations.select>` on the
        executor thread, with the offered prefix; the offer ends with it."""
        offer = self._offer[0] if self._offer is not None else None
        try:
            self.executor.call(self.parking.select, gen, prompt, request_id, session, offer, notes)
        finally:
            self.end_offer()

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.parking, name, value)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.parking, name)
        if not callable(value):
            return value
        executor = self.executor

        def on_executor(*args: Any, **kwargs: Any) -> Any:
            return executor.call(value, *args, **kwargs)

        return on_executor

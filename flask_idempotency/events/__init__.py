"""Events: a transactional outbox, a relay to the broker and idempotent consumers.

``idempotency.emit()`` (``outbox.py``) writes an event in the transaction that
stores the answer; ``flask idempotency relay`` (``relay.py``) publishes it with
confirms; ``@idempotency.consumer(name)`` (``consumer.py``) runs a handler once in
effect per message. kombu (the ``[events]`` extra) is imported only by what
talks to a broker (``amqp.py``); the embedded path (``relay.py``'s
``EmbeddedEvents``) needs none.

The names below load on first use: an application that only emits (every
request that stores an answer may) never imports the relay, the consumer or a
broker client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .amqp import ConsumerWorker, Subscription
    from .messages import ConsumerOutcome, Delivery
    from .relay import EmbeddedEvents, Relay

#: Where each public name lives: what an application writes to run consumers and
#: the relay. What they hand back (``ConsumerGuard``, ``messages.Result``, ``RelayStats``)
#: and the broker's parts (``Publisher``, ``BrokerUnavailable``) are documented in
#: their modules.
_HOMES = {
    "ConsumerWorker": "amqp",
    "Subscription": "amqp",
    "ConsumerOutcome": "messages",
    "Delivery": "messages",
    "EmbeddedEvents": "relay",
    "Relay": "relay",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = [
    "ConsumerOutcome",
    "ConsumerWorker",
    "Delivery",
    "EmbeddedEvents",
    "Relay",
    "Subscription",
]

"""Events: a transactional outbox, a relay to the broker and idempotent consumers.

``idempotency.emit()`` (``outbox.py``) writes an event in the transaction that
stores the answer; ``flask idempotency relay`` (``relay.py``) publishes it with
confirms; ``@idempotency.consumer(name)`` (``consumer.py``) runs a handler once in
effect per message. kombu (the ``[events]`` extra) is imported only by what
talks to a broker (``amqp.py``, ``embedded.py``).
"""

from .amqp import BrokerUnavailable, ConsumerWorker, Publisher, Subscription
from .consumer import ConsumerGuard, Delivery, Outcome, Result
from .embedded import EmbeddedEvents
from .outbox import OutboxEvent
from .relay import Relay, RelayStats

__all__ = [
    "BrokerUnavailable",
    "ConsumerGuard",
    "ConsumerWorker",
    "Delivery",
    "EmbeddedEvents",
    "OutboxEvent",
    "Outcome",
    "Publisher",
    "Relay",
    "RelayStats",
    "Result",
    "Subscription",
]

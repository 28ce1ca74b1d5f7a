"""``python -m example_app.receipts``: the receipts consumer (CONTRACT §4, §5).

With ``AMQP_URL``: consumes the ``receipts`` queue on RabbitMQ (reconnecting by
itself when the broker goes away). Without it: relays the outbox straight to
the handler, in this one process. Stops on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from example_app import create_app
from example_app.receipts import embedded, subscription
from flask_idempotency.events import ConsumerWorker
from flask_idempotency.events.amqp import redact

log = logging.getLogger("example_app.receipts")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app()
    stop = threading.Event()
    url = app.config.get("AMQP_URL")
    try:
        if url:
            worker = ConsumerWorker(app, url, [subscription(app.config)])
            _on_signals(stop.set)
            log.info("receipts: consuming from %s", redact(url))
            counts = worker.run(stop)
            log.info("receipts: stopped; %s", dict(counts))
        else:
            events = embedded(app)
            _on_signals(events.stop)
            log.info("receipts: no AMQP_URL; relaying the outbox in this process")
            events.run()
    finally:
        app.extensions["idempotency"].close()


def _on_signals(stop: Callable[[], None]) -> None:
    def handler(signum: int, frame: object) -> None:
        stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


if __name__ == "__main__":
    main()

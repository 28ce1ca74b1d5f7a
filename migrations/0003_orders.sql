-- POST /v1/orders (example_app/orders.py): an order goes through three phases,
-- reserve, charge and notify, each committed with the idempotency record's
-- progress (flask_idempotency/phases.py), so a takeover after a crash resumes
-- after the last one instead of reserving, charging or notifying again.
CREATE TABLE IF NOT EXISTS orders (
    id               text        PRIMARY KEY,
    seq              bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
    -- SHA-256 of the API key that placed the order, as for charges.
    owner            text        NOT NULL,
    customer         text        NOT NULL,
    sku              text        NOT NULL,
    quantity         integer     NOT NULL CHECK (quantity BETWEEN 1 AND 1000),
    amount           bigint      NOT NULL CHECK (amount BETWEEN 1 AND 99999999),
    currency         text        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    -- reserved -> paid -> confirmed, or reserved -> declined.
    status           text        NOT NULL,
    -- One row per external result: a phase that ran twice could not record it twice.
    reservation_id   text        NOT NULL UNIQUE,
    payment_id       text        UNIQUE,
    notification_id  text        UNIQUE,
    created_at       timestamptz NOT NULL DEFAULT now()
);

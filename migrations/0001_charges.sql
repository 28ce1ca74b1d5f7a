-- The example payments API's charges, applied by `flask idempotency migrate`
-- (IDEMPOTENCY_MIGRATION_DIRS) after the extension's own schema, under the same
-- advisory lock, so gunicorn workers starting together apply it once.
CREATE TABLE IF NOT EXISTS charges (
    id           text        PRIMARY KEY,
    -- Insertion order: breaks ties between charges created in the same second.
    seq          bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
    -- SHA-256 of the API key that created the charge: a leaked table holds no keys.
    owner        text        NOT NULL,
    customer     text        NOT NULL,
    amount       bigint      NOT NULL CHECK (amount BETWEEN 1 AND 99999999),
    currency     text        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    description  text,
    status       text        NOT NULL,
    -- The processor's payment: one payment is never recorded as two charges,
    -- whatever happens to the idempotency record.
    payment_id   text        NOT NULL UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- GET /v1/charges?customer=...: one owner's charges of one customer.
CREATE INDEX IF NOT EXISTS charges_owner_customer_idx ON charges (owner, customer, seq);

-- The receipts service's table (example_app/receipts): one receipt per charge,
-- written by the `charge.succeeded` consumer inside its guard's transaction.
CREATE TABLE IF NOT EXISTS receipts (
    id           text        PRIMARY KEY,
    seq          bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
    -- One receipt per charge. The consumer guard is what makes a redelivered or
    -- re-published event a no-op; this constraint only backs it up (a second
    -- insert would fail the handler, never write a second receipt).
    charge       text        NOT NULL UNIQUE,
    -- The event it was written for (its message id).
    event_id     text        NOT NULL,
    owner        text        NOT NULL,
    customer     text        NOT NULL,
    amount       bigint      NOT NULL,
    currency     text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- GET /v1/receipts?customer=...: one owner's receipts of one customer.
CREATE INDEX IF NOT EXISTS receipts_owner_customer_idx ON receipts (owner, customer, seq);

#!/usr/bin/env bash
# Step "load": fill the source database with deterministic data (50,000+ rows).
set -euo pipefail
source "$(dirname "$0")/common.sh"

log "loading tables into $SRC_DB"
pg -d "$SRC_DB" <<'SQL'
BEGIN;
CREATE TABLE customers (
    id      integer PRIMARY KEY,
    name    text    NOT NULL,
    region  text    NOT NULL
);
INSERT INTO customers
SELECT g, 'customer-' || g, (ARRAY['north','south','east','west'])[1 + g % 4]
FROM generate_series(1, 2000) AS g;

CREATE TABLE orders (
    id           bigint      PRIMARY KEY,
    customer_id  integer     NOT NULL REFERENCES customers,
    placed_at    timestamptz NOT NULL,
    total_cents  bigint      NOT NULL CHECK (total_cents >= 0)
);
INSERT INTO orders
SELECT g, 1 + (g * 7919) % 2000,
       timestamptz '2024-01-01 00:00:00+00' + g * interval '37 minutes',
       (g * 104729) % 100000
FROM generate_series(1, 12000) AS g;

CREATE TABLE order_items (
    order_id  bigint  NOT NULL REFERENCES orders,
    line      integer NOT NULL,
    sku       text    NOT NULL,
    qty       integer NOT NULL CHECK (qty > 0),
    PRIMARY KEY (order_id, line)
);
INSERT INTO order_items
SELECT o, l, 'sku-' || ((o * 31 + l) % 500), 1 + (o + l) % 5
FROM generate_series(1, 12000) AS o, generate_series(1, 3) AS l;

CREATE INDEX orders_customer_idx ON orders (customer_id);
CREATE VIEW region_revenue AS
SELECT c.region, count(*) AS orders, sum(o.total_cents) AS revenue_cents
FROM orders o JOIN customers c ON c.id = o.customer_id
GROUP BY c.region;
COMMIT;
ANALYZE;
SQL
total=$(pg_scalar "$SRC_DB" "SELECT (SELECT count(*) FROM customers) + (SELECT count(*) FROM orders) + (SELECT count(*) FROM order_items)")
log "loaded $total rows into $SRC_DB"
[ "$total" -ge 10000 ] || { echo "expected at least 10000 rows, got $total" >&2; exit 1; }

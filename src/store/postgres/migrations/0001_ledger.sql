-- Version 1: the tables the SQLite store keeps, for a fleet sharing one database.
-- Applied once, in one transaction, under the migration advisory lock (see migrate.rs).
-- Times are ms since the epoch (BIGINT), days are days since the epoch (UTC), as in SQLite.

-- One row per charged upstream call. `id` is the call's reservation id (or, for a call
-- with none, an id from the same space): a charge is written once per id, whoever
-- writes it (the replica settling it, a retry, or the replica recovering a dead one's
-- reservations) — every insert is ON CONFLICT (id) DO NOTHING.
CREATE TABLE ledger (
    id BIGINT PRIMARY KEY,
    ts_ms BIGINT NOT NULL,
    day BIGINT NOT NULL,
    tenant TEXT NOT NULL,
    session TEXT,
    model TEXT NOT NULL,
    calls BIGINT NOT NULL,
    input_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    usd DOUBLE PRECISION NOT NULL
);
CREATE INDEX ledger_by_session ON ledger (tenant, session, ts_ms);
-- Day budgets, the admin view and reports by tenant, day and model.
CREATE INDEX ledger_by_day ON ledger (tenant, day, model);
-- The retention purge (ids are not in time order across replicas).
CREATE INDEX ledger_by_time ON ledger (ts_ms);

-- Each process that opens the store takes an epoch: the high bits of every id it
-- assigns (so ids are unique across replicas without a round trip each), and the name
-- under which it heartbeats. 2^20 process starts; an id's low 43 bits are its count.
CREATE SEQUENCE replica_epochs MINVALUE 1 MAXVALUE 1048575 NO CYCLE;
CREATE TABLE replicas (
    epoch BIGINT PRIMARY KEY,
    started_ms BIGINT NOT NULL,
    seen_ms BIGINT NOT NULL
);

-- Budgeted calls in flight, durable before their upstream call. A replica not seen for
-- `store.replica_lease` is dead: another charges its reservations at their reserved
-- amount (into the ledger, under the reservation's id).
CREATE TABLE reservations (
    id BIGINT PRIMARY KEY,
    epoch BIGINT NOT NULL,
    ts_ms BIGINT NOT NULL,
    day BIGINT NOT NULL,
    tenant TEXT NOT NULL,
    session TEXT,
    model TEXT NOT NULL,
    calls BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    usd DOUBLE PRECISION NOT NULL
);
CREATE INDEX reservations_by_epoch ON reservations (epoch);

CREATE TABLE idempotency (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    status INTEGER NOT NULL,
    content_type TEXT NOT NULL,
    body BYTEA NOT NULL,
    expires_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX idempotency_by_expiry ON idempotency (expires_ms);

-- A key claimed by the request making its call (on any replica), until `until_ms` on
-- the database's clock.
CREATE TABLE idempotency_claims (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    until_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, key)
);

CREATE TABLE response_owners (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    expires_ms BIGINT NOT NULL,
    context_tokens BIGINT
);
CREATE INDEX response_owners_by_expiry ON response_owners (expires_ms);

-- Settles the shared state (Redis) could not take yet, replayed until it does.
CREATE TABLE shared_settles (
    reservation TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    queued_ms BIGINT NOT NULL
);

CREATE TABLE session_resets (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, session)
);

CREATE TABLE guard_states (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    closed BOOLEAN NOT NULL,
    until_ms BIGINT NOT NULL,
    code TEXT NOT NULL,
    rule TEXT NOT NULL,
    evidence TEXT NOT NULL,
    updated_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, session)
);

-- A session guard's counted state shared by the replicas, replaced by compare-and-set
-- on `version`; gone (version 0 again) once `expires_ms` passes on the database's clock.
CREATE TABLE guard_windows (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    version BIGINT NOT NULL,
    state TEXT NOT NULL,
    expires_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant, session)
);

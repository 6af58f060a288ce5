-- Version 4: sessions' side-effect journals (`[tenants.side_effects]`), one row per
-- journaled tool call, its entry as versioned JSON. Shared by every replica on this
-- database; purged with the ledger's retention.
CREATE TABLE IF NOT EXISTS side_effects (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    call_id TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    proposed BOOLEAN NOT NULL,
    entry TEXT NOT NULL,
    PRIMARY KEY (tenant, session, call_id)
);

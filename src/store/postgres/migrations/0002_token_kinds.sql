-- Version 2: every token kind a provider bills, on its own column of the ledger: cache
-- writes (every lifetime; the one-hour part apart), cache reads, reasoning (a part of
-- output) and server-side web searches. Rows written before, and by replicas of an
-- older build during a rolling upgrade, read 0: they were charged on input and output.
ALTER TABLE ledger
    ADD COLUMN cache_write_tokens BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN cache_write_1h_tokens BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN cache_read_tokens BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN reasoning_tokens BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN web_searches BIGINT NOT NULL DEFAULT 0;

-- Version 3: a row written by the recovery of a replica taken for dead (its reservation
-- charged at the reserved amount) is marked, so that the replica's own settle, arriving
-- later or replayed from its spool, corrects it to the call's true charge, once. Rows
-- written before were settles or recoveries alike: unmarked, they are never corrected.
ALTER TABLE ledger ADD COLUMN recovered BOOLEAN NOT NULL DEFAULT false;

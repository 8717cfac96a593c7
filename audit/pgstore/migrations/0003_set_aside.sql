-- 0003_set_aside: records the store rejects for good (audit.ErrRecordRejected:
-- a value over the store's bounds, or PostgreSQL SQLSTATE class 22 / 54),
-- kept with the reason instead of stalling the audit (audit.SetAsider).
CREATE TABLE set_aside (
	id           text PRIMARY KEY,          -- kind || ':' || hex SHA-256 of the record ID
	kind         text NOT NULL,             -- 'arrival' or 'attempt'
	record_id    text NOT NULL,             -- cut to 256 bytes
	message_id   text NOT NULL,             -- cut to 256 bytes
	reason       text NOT NULL,
	record       bytea NOT NULL,            -- the record as JSON
	set_aside_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX set_aside_at_idx ON set_aside (set_aside_at);

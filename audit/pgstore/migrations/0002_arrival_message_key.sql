-- 0002_arrival_message_key: the message key of an arrival as a stored
-- column: its message id, or for an arrival without one its own record ID
-- (such a message is listed on its own, not merged under ''). Every lookup
-- of a message's arrivals goes through it, so joins with messages use
-- plain index lookups. Rewrites arrivals (cheap on a new store).
ALTER TABLE arrivals
	ADD COLUMN message_key text GENERATED ALWAYS AS (CASE WHEN message_id = '' THEN id ELSE message_id END) STORED;
CREATE INDEX arrivals_message_key_idx ON arrivals (message_key, arrived_at);
DROP INDEX arrivals_message_id_idx;

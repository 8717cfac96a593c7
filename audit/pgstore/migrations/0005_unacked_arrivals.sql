-- 0005_unacked_arrivals: the arrivals whose delivery is committed but not
-- yet acked (audit.DeliveryLog). A row is written in the transaction that
-- stores its arrival, marked acking right before the Consumer sends the
-- ack, and deleted by the Consumer's next mark (that ack was sent). When
-- the Consumer session that holds a row ends before the ack (its process
-- died between commit and ack), RabbitMQ redelivers the message and the
-- next Consumer claims the row (moves it to its own session) instead of
-- storing the arrival again; an acking row is never claimed (its ack may
-- have reached RabbitMQ): a matching redelivery is stored again, flagged
-- maybe_duplicate. fingerprint is a hex SHA-256 over the audit queue and
-- the delivery's content (equal for identical publishes, one row each);
-- session is the holding Consumer session's random token. Rows older than
-- a day are pruned (a process that died for good).
CREATE TABLE unacked_arrivals (
	arrival_id  text PRIMARY KEY,
	fingerprint text NOT NULL,
	session     text NOT NULL,
	since       timestamptz NOT NULL DEFAULT now(),
	acking      boolean NOT NULL DEFAULT false
) WITH (fillfactor = 50);
CREATE INDEX unacked_arrivals_fingerprint ON unacked_arrivals (fingerprint);
CREATE INDEX unacked_arrivals_since ON unacked_arrivals (since);

-- 0004_exact_arrivals: an arrival's headers exactly as they arrived (the
-- AMQP field table, amqpretry.EncodeHeaderTable's base64 text, NULL for
-- arrivals recorded before: their resend falls back to the JSON headers),
-- whether an arrival may duplicate another (audit.Arrival.MaybeDuplicate:
-- recorded from a redelivery the consumer could not match to its first
-- delivery), and the broker-validated user that published an attempt record (AMQP
-- user-id). Both columns are added without rewriting the tables.
ALTER TABLE arrivals ADD COLUMN header_table text NULL;
ALTER TABLE arrivals ADD COLUMN maybe_duplicate boolean NOT NULL DEFAULT false;
ALTER TABLE attempts ADD COLUMN recorded_by text NOT NULL DEFAULT '';

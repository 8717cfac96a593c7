-- 0001_init: the audit tables. Runs with search_path set to the store's
-- schema (Config.Schema), inside one transaction under the migration lock.

-- One row per message published to an audited business exchange.
CREATE TABLE arrivals (
	id             text PRIMARY KEY,            -- audit.Arrival.ID (hex SHA-256)
	message_id     text NOT NULL,               -- Watermill UUID ('' if none)
	correlation_id text NOT NULL DEFAULT '',
	exchange       text NOT NULL,
	routing_key    text NOT NULL,
	published_at   timestamptz NULL,            -- AMQP timestamp, NULL if unset
	arrived_at     timestamptz NOT NULL,
	headers        jsonb NOT NULL DEFAULT '{}',
	properties     jsonb NOT NULL DEFAULT '{}',
	body           bytea NOT NULL,
	body_size      integer NOT NULL,
	body_truncated boolean NOT NULL DEFAULT false,
	recorded_at    timestamptz NOT NULL DEFAULT now()
);

-- One row per attempt the retry chain made at a message.
CREATE TABLE attempts (
	id             text PRIMARY KEY,            -- audit.Attempt.ID (UUID)
	message_id     text NOT NULL,
	correlation_id text NOT NULL DEFAULT '',
	queue          text NOT NULL,
	attempt        integer NOT NULL,
	started_at     timestamptz NOT NULL,
	duration_us    bigint NOT NULL DEFAULT 0,   -- handler run time, microseconds
	outcome        text NOT NULL,
	delay_ms       bigint NOT NULL DEFAULT 0,   -- retry delay, milliseconds
	tier_ms        bigint NOT NULL DEFAULT 0,   -- wait queue's delay, milliseconds
	error_class    text NOT NULL DEFAULT '',
	error          text NOT NULL DEFAULT '',
	recorded_at    timestamptz NOT NULL DEFAULT now()
);

-- One row per message id, maintained by Write in the same transaction:
-- the message's time (its first arrival, else its first attempt's start),
-- which Search sorts and pages by, and its latest attempt's outcome.
CREATE TABLE messages (
	message_id       text PRIMARY KEY,
	first_arrival_at timestamptz NULL,
	first_started_at timestamptz NULL,
	message_time     timestamptz GENERATED ALWAYS AS (COALESCE(first_arrival_at, first_started_at)) STORED,
	last_attempt     integer NULL,
	last_started_at  timestamptz NULL,
	last_attempt_id  text NULL,
	last_outcome     text NULL
);

CREATE INDEX messages_time_idx ON messages (message_time, message_id);
CREATE INDEX messages_last_outcome_idx ON messages (last_outcome, message_time);

CREATE INDEX arrivals_message_id_idx ON arrivals (message_id, arrived_at);
CREATE INDEX arrivals_correlation_id_idx ON arrivals (correlation_id) WHERE correlation_id <> '';
CREATE INDEX arrivals_arrived_at_idx ON arrivals (arrived_at);
CREATE INDEX arrivals_exchange_rk_idx ON arrivals (exchange, routing_key);
CREATE INDEX arrivals_headers_idx ON arrivals USING gin (headers jsonb_path_ops);

CREATE INDEX attempts_message_id_idx ON attempts (message_id, started_at);
CREATE INDEX attempts_correlation_id_idx ON attempts (correlation_id) WHERE correlation_id <> '';
CREATE INDEX attempts_started_at_idx ON attempts (started_at);
CREATE INDEX attempts_queue_started_at_idx ON attempts (queue, started_at);
CREATE INDEX attempts_outcome_idx ON attempts (outcome, error_class);
CREATE INDEX attempts_error_class_idx ON attempts (error_class) WHERE error_class <> '';

-- ErrorContains (ILIKE '%...%') is served by a pg_trgm GIN index when the
-- extension is installed or can be (CREATE EXTENSION needs a privileged
-- role); otherwise Search scans the attempts the other conditions leave.
-- The extension goes to schema public, never to the store's schema, so
-- dropping one store's schema never drops it from under another.
DO $$
DECLARE
	ext_schema text;
BEGIN
	-- One store at a time decides about the extension (database-wide).
	PERFORM pg_advisory_xact_lock(hashtext('rabbitretry_audit:pg_trgm'));
	SELECT n.nspname INTO ext_schema
	FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
	WHERE e.extname = 'pg_trgm';
	IF ext_schema IS NULL THEN
		BEGIN
			CREATE EXTENSION IF NOT EXISTS pg_trgm SCHEMA public;
			ext_schema := 'public';
		EXCEPTION WHEN OTHERS THEN
			RAISE NOTICE 'rabbitretry audit: pg_trgm unavailable (%), ErrorContains will scan', SQLERRM;
			RETURN;
		END;
	END IF;
	EXECUTE format('CREATE INDEX attempts_error_trgm_idx ON attempts USING gin (error %I.gin_trgm_ops)', ext_schema);
END
$$;

-- Voided usage events (issue 10, item 6). When recording a served request's usage timed out,
-- its outcome is unknown; the proxy answers the client with an error only after voiding the
-- event id: a row with status 'voided' under the same primary key, so a late INSERT … ON
-- CONFLICT (id) DO NOTHING of that event (a stalled batch, a journal replay) is a no-op and the
-- request the client was told failed is never charged. A voided row is never pending, never
-- accounted and has no seq.
ALTER TABLE usage_events DROP CONSTRAINT usage_events_status_check;
ALTER TABLE usage_events ADD CONSTRAINT usage_events_status_check CHECK (status IN ('pending', 'accounted', 'voided'));
ALTER TABLE usage_events DROP CONSTRAINT usage_events_check;
ALTER TABLE usage_events ADD CONSTRAINT usage_events_seq_check CHECK ((status = 'accounted') = (seq IS NOT NULL));

-- Reports, exports and the console's ranges read a request's time as its reserve time, as limits
-- do (coalesce(reserved_at, created_at): fail-open requests have no reserve time and count at
-- their record time), so that an hour, a day or a range adds up the same in every view. A usage
-- event is recorded moments after its reserve, so the expression follows the insertion order as
-- closely as created_at did, and a BRIN index on it serves the top spenders' cross-org range scan
-- as the one on created_at did; that one has no reader left.
CREATE INDEX usage_events_at_brin ON usage_events USING brin ((coalesce(reserved_at, created_at))) WITH (autosummarize = on);
DROP INDEX usage_events_created_brin;

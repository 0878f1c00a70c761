-- The top spenders of a time range (Console.TopSpenders) read the accounted requests recorded in
-- that range across every org. Usage events are inserted in created_at order, so a BRIN index
-- (a few pages for millions of rows, next to nothing to maintain on the request path) lets that
-- scan skip every block outside the range. autosummarize: each filled range of pages is
-- summarized soon after (an unsummarized range is always read), not only at the next vacuum.
CREATE INDEX usage_events_created_brin ON usage_events USING brin (created_at) WITH (autosummarize = on);

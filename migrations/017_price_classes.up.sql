-- Prices as data (issue 32): a model's prices are a map class → price (pricing.Class; the
-- registry in pricing/class.go says each class's unit and default), and a usage event's units of
-- the classes beyond text tokens are a map class → units. Adding a class needs no migration.
--
-- models.prices holds the classes a model prices. input and output are copied always (a price
-- of 0 there was 0); cached and cache-write prices only when not 0 (0 meant "the default":
-- the input price, 2× it for 1-hour writes — absent says the same).
ALTER TABLE models ADD COLUMN prices jsonb NOT NULL DEFAULT '{}'
    CHECK (jsonb_typeof(prices) = 'object');
UPDATE models SET prices = jsonb_strip_nulls(jsonb_build_object(
    'input', input_price,
    'output', output_price,
    'cached_input', NULLIF(cached_input_price, 0),
    'cache_write_input', NULLIF(cache_write_input_price, 0),
    'cache_write_1h_input', NULLIF(cache_write_1h_input_price, 0)));

-- usage_events.units: the units of each class other than text tokens, disjoint
-- (pricing.Usage): cache_write_tokens counted the 5-minute and the 1-hour writes, the 1-hour
-- ones are cache_write_1h_input and the rest cache_write_input. NULL when there are none (most
-- events: a text request without a cache hit), which costs the row no bytes. prompt_tokens,
-- completion_tokens and reasoning_tokens stay columns: every input, every output token, as
-- reports and token limits count them.
ALTER TABLE usage_events ADD COLUMN units jsonb;
UPDATE usage_events SET units = NULLIF(jsonb_strip_nulls(jsonb_build_object(
    'cached_input', NULLIF(cached_tokens, 0),
    'cache_write_input', NULLIF(cache_write_tokens - cache_write_1h_tokens, 0),
    'cache_write_1h_input', NULLIF(cache_write_1h_tokens, 0))), '{}')
WHERE cached_tokens <> 0 OR cache_write_tokens <> 0 OR cache_write_1h_tokens <> 0;

-- The old columns stay (read and written by no code of this release) so that a process of the
-- previous release still writes its events and reads models during a rolling upgrade; see
-- docs/price-classes.md. A later release drops them.

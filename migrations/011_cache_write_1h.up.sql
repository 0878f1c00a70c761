-- Anthropic's 1-hour prompt cache (issue 23): a model's price for an input token written to the
-- 1-hour cache (usage.cache_creation.ephemeral_1h_input_tokens), and each usage event's count of
-- them, a part of cache_write_tokens (which counts the 5-minute and the 1-hour writes). A price
-- of 0 here, like a cached or cache-write price of 0, is not "free": pricing.Prices.WithDefaults
-- prices it (2× the input price for 1-hour writes, the input price for the others).
ALTER TABLE models ADD COLUMN cache_write_1h_input_price bigint NOT NULL DEFAULT 0
    CHECK (cache_write_1h_input_price BETWEEN 0 AND 100000000000000);
ALTER TABLE usage_events ADD COLUMN cache_write_1h_tokens bigint NOT NULL DEFAULT 0
    CHECK (cache_write_1h_tokens >= 0);

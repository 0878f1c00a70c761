-- Prompt-cache writes (issue 15, Anthropic Messages): a model's price for an input token
-- written to the provider's cache (cache_creation_input_tokens), and each usage event's count
-- of them. prompt_tokens stays "every input token" (it includes cached_tokens and
-- cache_write_tokens), as pricing.Usage documents.
ALTER TABLE models ADD COLUMN cache_write_input_price bigint NOT NULL DEFAULT 0
    CHECK (cache_write_input_price BETWEEN 0 AND 100000000000000);
ALTER TABLE usage_events ADD COLUMN cache_write_tokens bigint NOT NULL DEFAULT 0
    CHECK (cache_write_tokens >= 0);

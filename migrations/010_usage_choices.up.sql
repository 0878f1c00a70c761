-- The number of choices a request asked for (n / best_of; issue 12): the account pass learns a
-- model's max cost per choice, ⌈cost / choices⌉, from the events it accounts. Rows written
-- before this column existed were single-choice as far as the learned max is concerned.
ALTER TABLE usage_events ADD COLUMN choices bigint NOT NULL DEFAULT 1 CHECK (choices >= 1);

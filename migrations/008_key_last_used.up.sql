-- When each API key was last used: the reserve time of its latest accounted request, kept by the
-- account pass (one update per key per batch, never per request).
ALTER TABLE api_keys ADD COLUMN last_used_at timestamptz;

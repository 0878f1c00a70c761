-- A key limited to models (issue 36): NULL serves every model; else the model names it may use,
-- an entry ending in '*' a prefix. Others are answered 404 model_not_found, as if absent.
ALTER TABLE api_keys ADD COLUMN models text[];

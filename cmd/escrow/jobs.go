package main

import (
	"net/http"
	"net/url"

	"github.com/llmescrow/escrow/ledger/job"
)

var jobTable = table[job.Job]{
	{"id", func(j job.Job) string { return j.ID }},
	{"kind", func(j job.Job) string { return string(j.Kind) }},
	{"org", func(j job.Job) string { return j.Org }},
	{"upstream_id", func(j job.Job) string { return j.UpstreamID }},
	{"model", func(j job.Job) string { return j.Model }},
	{"status", func(j job.Job) string { return string(j.Status) }},
	{"hold", func(j job.Job) string { return i64(j.Hold) }},
	{"cost", func(j job.Job) string { return i64(j.Cost) }},
	{"unresolved", func(j job.Job) string {
		if j.Unresolved {
			return "yes"
		}
		return ""
	}},
	{"polls", func(j job.Job) string { return i64(int64(j.Attempts)) }},
	{"created_at", func(j job.Job) string { return ts(j.CreatedAt) }},
	{"settled_at", func(j job.Job) string { return optTS(j.SettledAt) }},
}

// cmdJobs: escrow jobs [ORG] [--kind K] [--live] [--limit N] — background responses and
// batches, newest first, with their status, hold and cost.
func cmdJobs(args []string) error {
	fs, o := newFlags("jobs")
	kind := fs.String("kind", "", "background_response, openai_batch or anthropic_batch (default: all)")
	live := fs.Bool("live", false, "only jobs not settled yet (holding their hold)")
	limit := fs.String("limit", "", "at most this many (default 100, at most 1000)")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 1 {
		return usageErr("usage: escrow jobs [ORG] [--kind K] [--live] [--limit N] [--json|--csv]")
	}
	path := "/jobs"
	if len(pos) == 1 {
		path = "/orgs/" + url.PathEscape(pos[0]) + "/jobs"
	}
	q := url.Values{}
	setGiven(q, map[string]string{"kind": *kind, "limit": *limit})
	if *live {
		q.Set("live", "true")
	}
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	v, raw, err := fetch[struct {
		Jobs []job.Job `json:"jobs"`
	}](c, http.MethodGet, path, nil)
	if err != nil {
		return err
	}
	return jobTable.print(o, raw, v.Jobs)
}

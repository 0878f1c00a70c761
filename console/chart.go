package console

import (
	"cmp"
	"slices"
	"time"

	"github.com/llmescrow/escrow/ledger"
)

// Charts are drawn here as inline SVG (no script, nothing for the CSP to allow): each bar is a
// rect carrying its group and its exact cost in micro-units (data-group, data-cost) and a
// title for the pointer; a table under each chart holds the same rows as text.

// ChartDays is how many days the usage charts cover, today (UTC) included.
const ChartDays = 30

// Bar is one bar of a chart.
type Bar struct {
	Group    string
	Cost     int64
	Requests int64
	X, Y     int // top-left corner
	W, H     int
}

// Chart is a bar chart in a viewBox of W×H.
type Chart struct {
	W, H int
	Bars []Bar
	Max  int64 // the largest cost (the scale)
	Rows []ledger.UsageRow
	// Ticks label the day chart's axis (a few dates under it); Top is where the bars stop.
	Ticks []Tick
	Top   int
}

// Tick is a label under the day chart's axis.
type Tick struct {
	X    int
	Text string
}

const (
	chartW, chartH = 720, 180
	modelBarH      = 22
)

// dayChart is the org's cost per UTC day for the ChartDays days ending on today, a day
// without usage a zero bar; rows are UsageReport's by day.
func dayChart(rows []ledger.UsageRow, today time.Time) Chart {
	by := make(map[string]ledger.UsageRow, len(rows))
	for _, r := range rows {
		by[r.Group] = r
	}
	ch := Chart{W: chartW, H: chartH + 18, Top: chartH}
	start := today.AddDate(0, 0, -(ChartDays - 1))
	for i := range ChartDays {
		d := start.AddDate(0, 0, i).Format("2006-01-02")
		r := by[d]
		r.Group = d
		ch.Rows = append(ch.Rows, r)
		ch.Max = max(ch.Max, r.Cost)
	}
	slot := chartW / ChartDays
	for i, r := range ch.Rows {
		h := scale(r.Cost, ch.Max, chartH-20)
		ch.Bars = append(ch.Bars, Bar{Group: r.Group, Cost: r.Cost, Requests: r.Requests, X: i*slot + 2, Y: chartH - h, W: slot - 4, H: h})
		if i%7 == 0 || i == ChartDays-1 {
			ch.Ticks = append(ch.Ticks, Tick{X: i * slot, Text: r.Group[5:]})
		}
	}
	return ch
}

// modelChart is the org's cost per model, one horizontal bar each, the largest cost first
// (rows are UsageReport's by model).
func modelChart(rows []ledger.UsageRow) Chart {
	rows = slices.Clone(rows)
	slices.SortStableFunc(rows, func(a, b ledger.UsageRow) int {
		return cmp.Or(cmp.Compare(b.Cost, a.Cost), cmp.Compare(a.Group, b.Group))
	})
	ch := Chart{W: chartW, Rows: rows}
	for _, r := range rows {
		ch.Max = max(ch.Max, r.Cost)
	}
	for i, r := range rows {
		ch.Bars = append(ch.Bars, Bar{Group: r.Group, Cost: r.Cost, Requests: r.Requests, X: 200, Y: i * modelBarH,
			W: scale(r.Cost, ch.Max, chartW-210), H: modelBarH - 4})
	}
	ch.H = max(len(rows)*modelBarH, modelBarH)
	return ch
}

// scale is v's length on a scale where top is full (at least 1 for a non-zero value).
func scale(v, top int64, full int) int {
	if v <= 0 || top <= 0 {
		return 0
	}
	return max(int(float64(v)/float64(top)*float64(full)), 1)
}

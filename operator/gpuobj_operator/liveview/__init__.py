"""The live view: every object the agents hold, served read-only through an aggregated API (docs/live-view.md).

`rows` is pure (rows, tables, paging tokens); `server` is the HTTP edge (authentication, authorization,
the fan-out to the agents)."""

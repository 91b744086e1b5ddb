"""The one generation pipeline every front end shares: a request validated against the replica's
limits, fanned out into n engine requests, merged into chunks and finished records."""

"""OpenAI's Responses API: `POST /v1/responses` (and a stored response read back or deleted),
the wire API Codex speaks. `schemas` (the request body), `translate` (input items into the
one request shape, an answer into output items, or into the Responses stream of events),
`store` (recent responses kept in memory for `previous_response_id`), `routes`.
"""

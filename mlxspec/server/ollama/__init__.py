"""Ollama's API (`/api/*`, NDJSON streams), the dialect editors' "local model" settings
speak: routes.py over schemas.py (requests in), replies.py (answers out) and
model_facts.py (what the model endpoints say)."""

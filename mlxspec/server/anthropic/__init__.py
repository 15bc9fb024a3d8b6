"""Anthropic's dialect: `/v1/messages` and `/v1/messages/count_tokens`, translated in and
out of the one request shape the server core serves, errors in Anthropic's shape.
"""

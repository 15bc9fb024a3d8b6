"""Structured output: a request's grammar (JSON schema, regex, Lark) compiled by llguidance,
and forced tool calls in each model's markup, as the constraint the round loop enforces on
the target and its drafts.

Imports markup/ (the model's call markup) and the leaves at the package root.
"""

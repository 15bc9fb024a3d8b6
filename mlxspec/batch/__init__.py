"""Continuous batching: several requests share one target forward per round."""

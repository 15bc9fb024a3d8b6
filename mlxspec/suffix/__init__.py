"""Suffix decoding's memory: a prefix-array index over token streams and the persistent
per-model history store it is kept in."""

"""Textual chat front end for mlxspec."""

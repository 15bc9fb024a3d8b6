"""The terminal front ends of mlxspec: the Textual chat, the line chat (`plain`), and an
answer echoed to a terminal (`echo`, for `generate` too)."""

"""Named models: models.toml read (the shipped file and the user's) and written (a drafter
trained or pulled here), and an entry assembled into a ready engine (`runtime`).

The layer just under the front ends: imports decoding/, the proposers and drafters, models/.
"""

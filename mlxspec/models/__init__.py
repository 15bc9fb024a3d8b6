"""The target model and what it runs: any model reference loaded into mlx-lm's classes (GGUF
and the packaged offline models included), a decoder's anatomy, the target's KV cache with
prefix reuse and rollback, and draft trees run over an unmodified decoder.

Imports only the leaves at the package root (device, sampling, paths, processes) and mlx-lm.
"""

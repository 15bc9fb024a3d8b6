"""Text in and out of a model: the one request shape inside (`Conversation`), conversations
as token ids through the model's chat template, and generated text read back into its parts
(reasoning, answer text, tool calls) in the model's own markup, harmony included.

Imports only the leaves at the package root (events, settings, logprobs) and mlx-lm.
"""

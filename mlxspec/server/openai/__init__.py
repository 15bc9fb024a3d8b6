"""OpenAI's dialect: `/v1/chat/completions` and `/v1/completions`, their request bodies, their
replies and stream chunks, and logprobs in OpenAI's two shapes, in and out of the one request
shape the server core serves.
"""

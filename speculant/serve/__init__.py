"""An OpenAI-compatible server with speculative decoding and continuous batching (`speculant serve`)."""

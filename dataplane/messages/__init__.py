"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), which vLLM
serves itself: routed by model like chat, and a replayable stream served as the chat request
that generates the same tokens, so it outlives its backend (dataplane/apis/messages.py)."""

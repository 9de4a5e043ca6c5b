"""Each API the shim serves, in one place (docs/architecture.md, DESIGN §8).

In the order a request meets them:

1. `table` maps each endpoint to its API (`api.Api`) and validates a request through it:
   `fields` checks what every API shares (the model, the sampling parameters, `stream`),
   then the API checks its own body (`chat`, `responses`, `messages`, `oneshot`).
2. The API says whether a stream is served as the chat request that generates the same
   tokens (`Api.as_chat`: Responses and Messages when they can be replayed), so it gets
   chat's token-exact failover, and its client sees its own API's events.
3. Every other request goes to the engine's own endpoint: a whole answer is checked by its
   API (`answers`), a stored response's id reaches control first (`Api.owned`), and a stream
   in the engine's own API is relayed by `passthrough`, which reads it through the API's
   `EngineStream` (its terminal events, what it stores, how it shows a failure).
4. Errors reach the client in the API's error shape (`Api.errors`: OpenAI's or Anthropic's).

A capability that crosses the APIs (sampling parameters today; tools, logprobs, adapters) is
written once, in a module of this room that each API's check or conversion calls.
"""

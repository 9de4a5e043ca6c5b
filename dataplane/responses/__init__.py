"""The Responses API (POST /v1/responses and a stored response's retrieve/delete/cancel).

In the order a request flows:

1. `request` reads it as vLLM does (input, instructions, store, previous_response_id) and
   says whether it can be replayed faithfully on another engine (replay_refusal).
2. A streamed, replayable request (store: false, no follow-up, text messages, function calls
   and their outputs, function tools with tool_choice auto or none, no reasoning: convert.py)
   is served as the chat request that generates the same tokens (request.as_chat,
   chosen by the API: dataplane/apis/responses.py), so it gets chat's token-exact mid-stream
   failover (dataplane/relay/);
   `translate` turns the relay's chat stream into Responses events (`events`: vLLM's
   shapes, one response id, rising sequence numbers, one response.completed with usage over
   the whole generation).
3. Every other request goes to the engine's own /v1/responses: whole, or streamed by
   dataplane/apis/passthrough.py, which tells control who stores the response before the
   client learns its id, and ends a stream whose engine died with `events.failed_event`
   (response.failed: it cannot be resumed).
4. `stored` routes retrieve/delete/cancel to the backend that holds the response; control
   refuses a follow-up whose owner is gone, and dataplane/refusals.py says so in an
   OpenAI-shaped 404.
"""

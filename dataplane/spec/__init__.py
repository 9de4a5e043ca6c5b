"""Router-level speculative decoding: a draft backend proposes, the target verifies, and the
shim writes the client's answer itself.

In the order the data flows:

1. `plan` (pure): which requests may use it (greedy, a length cap), how a round's draft is
   judged against the target's scores, and the loop detector reported with the outcome.
2. `server` (SpecServer) serves one request: the prompt's ids from the target, then rounds
   until the length cap or a stop, a target failure failed over through control (which
   re-pairs the draft), a new pairing's probe round judged by control's gate first.
3. `rounds` (Rounds) makes a round's calls: the draft's k tokens, the target's scores for
   context + draft and its own next token, or target-only generation without a draft.
4. `answer` (AnswerWriter) writes the client's answer in its own format (chat or
   completion, SSE or whole, with usage); `run` (SpecRun) keeps the request's state across
   rounds and failovers and builds the failover event and the outcome that control hears.
"""

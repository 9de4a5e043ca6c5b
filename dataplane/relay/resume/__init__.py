"""Mid-stream failover: a backend dies mid-stream and the client's stream goes on, token-exact.

In the order the data flows:

1. `relay` (StreamRelay) reads the engine's SSE stream (engine.read_events); `chunks`
   validates each chunk, `stitch` (Stitcher) writes it to the client and records, per
   choice, what the client now has in `progress` (ChoiceProgress: token ids, text,
   character boundaries; the stitcher is its one writer).
2. The stream breaks (EOF before [DONE], a reset, a stall, an error event): `choose`
   (Chooser) resumes on the route's next fallback at once (control's order, given in
   advance) and tells control once the resume flows; only when no fallback can take it
   does it wait for control's answer.
3. `plan` decides whether the choice can be resumed faithfully (refusal(), which builds no
   plan) and builds the resume request: token path (prompt ids + generated ids) or text
   path, with a seam overlap of m tokens starting at a known character boundary.
4. `attempt` (Resumer) opens it on the new backend (engine.open_attempt); `resumed`
   (ResumedStream) relays it: `seam` checks the new backend's first tokens against the
   overlap (SeamCheck) or derives the text of a prompt cut mid-character from ids
   (HeldText, with `detok`'s whole-character rule), `stops` matches stop strings there,
   `reasoning` and `markers` split a resumed raw stream into reasoning and content;
   `sidecheck` verifies the overlap beside the stream in parallel seam mode.
5. `stitch` carries on the client's stream (one id, no second role delta, usage over the
   whole generation); `reports` (Reporter) sends the failover's audit event, metric and
   span. A failed resume fails over again, within the retry budget; a choice that cannot
   be resumed ends in an explicit SSE error event, never a silent truncation.
"""

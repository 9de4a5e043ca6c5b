"""Discovery: engines found in the cluster join the fleet, and leave it, by themselves.

`[[discovery.kubernetes]]` watches a Service's EndpointSlices or pods by label selector
(kube.py: list, then watch from the list's resourceVersion, as client-go's reflector does);
`[[discovery.dns]]` re-resolves a name's A/AAAA/SRV records (dns.py). Each source turns what it
sees into endpoints (endpoints.py, pure): an id, a url, a phase (ready, not ready,
terminating) and the annotations that describe the engine. plan.py (pure) compares a source's
endpoints with the backends it added and says what to do: add, demote (drain), drain with
migrate (a terminating pod: its streams move before its SIGTERM), remove. runner.py is the
plumbing between: it asks an engine its model when nothing says it, and applies the plan
through the registry's ordinary paths, on the leading replica only.

Discovery never touches a backend from the config file or `baton backends add`, and what it
adds is not configuration: never saved, found again after a restart."""

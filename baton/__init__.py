"""Baton's shared core, beside the generated contract (`baton.v1`): what control, the shim and
the admin CLI all speak. `model` (domain types), `wire` (their one border with the *_pb2 types),
`spread` (spreading over a model's backends: control's policies and the shim's degraded mode),
`tracing` and `aio`. The core imports nothing of control's, the shim's or the CLI's
(tests/test_layering.py)."""

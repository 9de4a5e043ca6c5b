"""A stream that asked for logprobs resumes on vLLM's token-in/token-out endpoint
(/inference/v1/generate), which gives them in chat's shape: the plan, and the shapes the
client gets (chat's as they are, top_logprobs k long; completions' keyed by decoded token,
text_offset running on)."""

from __future__ import annotations

import pytest

from baton.model import SeamMode
from dataplane.exceptions import Refused
from dataplane.relay import logprobs
from dataplane.relay.resume import generate
from dataplane.relay.resume.plan import plan_resume
from tests.unit.test_resume import ONE_PER_CHUNK, chat, comp, progress

ENTRY = {"token": "é", "logprob": -0.1, "bytes": [195, 169], "top_logprobs": [
    {"token": "é", "logprob": -0.1, "bytes": [195, 169]},
    {"token": "\ufffd", "logprob": -2.0, "bytes": [239, 191, 189]},
    {"token": "\ufffd", "logprob": -3.0, "bytes": [239, 191, 189]}]}  # fmt: skip


def test_a_logprobs_chat_stream_resumes_on_generate_with_an_overlap_for_context() -> None:
    client = chat(logprobs=True, top_logprobs=2, max_tokens=20, seed=3)
    plan = plan_resume(client, progress(ONE_PER_CHUNK), token_path=True, seam_tokens=1)
    assert plan.engine_path == "/inference/v1/generate"
    assert plan.body["output_mode"] == "text" and plan.body["stream"] is True
    sampling = plan.body["sampling_params"]
    assert sampling["logprobs"] == 2 and sampling["seed"] == 3 and sampling["temperature"] == 0
    # At least 4 tokens regenerated and checked: vLLM decodes a token's candidates with the
    # 4 generated before it.
    assert plan.overlap_tokens >= generate.CONTEXT and len(plan.overlap_ids) >= 4
    kept = list(plan.body["token_ids"])
    assert kept[:2] == [1, 2] and len(kept) + len(plan.overlap_ids) == 2 + 8
    assert sampling["max_tokens"] == 20 - (len(kept) - 2)
    # Parallel seam mode opens logprobs resumes with the overlap too.
    assert not generate.opens_exact(SeamMode.PARALLEL, client)
    assert generate.opens_exact(SeamMode.PARALLEL, chat())


def test_logprobs_are_refused_where_they_cannot_be_exact() -> None:
    with pytest.raises(Refused, match="token ids"):
        plan_resume(chat(logprobs=True), progress(ONE_PER_CHUNK), token_path=False,
                    seam_tokens=4)  # fmt: skip
    sampled = comp(logprobs=2, temperature=0.7)
    with pytest.raises(Refused, match="sampled"):
        plan_resume(sampled, progress(ONE_PER_CHUNK), token_path=True, seam_tokens=4)
    greedy = plan_resume(comp(logprobs=2), progress(ONE_PER_CHUNK), token_path=True,
                         seam_tokens=4)  # fmt: skip
    assert greedy.body["sampling_params"]["logprobs"] == 2


def test_chat_gets_the_entries_with_k_candidates() -> None:
    assert logprobs.as_chat([ENTRY], 2)["content"][0]["top_logprobs"] == ENTRY["top_logprobs"][:2]
    assert logprobs.as_chat([ENTRY], 0)["content"][0]["top_logprobs"] == []


def test_completions_get_candidates_keyed_by_token_and_offsets_running_on() -> None:
    shaped, offset = logprobs.as_completions([ENTRY, {**ENTRY, "token": "ab"}], 5)
    assert shaped["text_offset"] == [5, 6] and offset == 8
    assert shaped["tokens"] == ["é", "ab"] and shaped["token_logprobs"] == [-0.1, -0.1]
    # Two candidates that decode alike: one key, in the first one's place, the last value.
    assert shaped["top_logprobs"][0] == {"é": -0.1, "\ufffd": -3.0}
    assert list(shaped["top_logprobs"][0]) == ["é", "\ufffd"]
    assert logprobs.next_offset(shaped, 0) == 8

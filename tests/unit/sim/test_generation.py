from __future__ import annotations

from sim.generation import Sequence, TokenEvent
from sim.model import ModelConfig, ToyModel
from sim.protocol import SamplingParams
from sim.tokenizer import build_tokenizer

TOK = build_tokenizer()
MODEL = ToyModel(ModelConfig(seed=0), TOK)
PROMPT = TOK.encode("<|bos|><|user|>hello<|end|><|assistant|>")


def run(params: SamplingParams) -> tuple[Sequence, list[TokenEvent]]:
    seq = Sequence(MODEL, PROMPT, params)
    events = []
    while not seq.finished:
        events.append(seq.step())
    return seq, events


def test_length_finish_reports_every_token_and_text() -> None:
    seq, events = run(SamplingParams(max_tokens=20))
    assert len(events) == 20 == len(seq.token_ids)
    assert [e.finish_reason for e in events] == [None] * 19 + ["length"]
    assert "".join(e.text for e in events) == TOK.decode(seq.token_ids) == seq.output_text()


def _stop_inside_output() -> tuple[str, str]:
    """A 3-char stop string that first occurs well inside the greedy output."""
    _, events = run(SamplingParams(max_tokens=200))
    full = "".join(e.text for e in events)
    stop = full[60:63]
    return full, stop


def test_stop_string_truncates_and_holds_back_partial_matches() -> None:
    full, stop = _stop_inside_output()
    seq, events = run(SamplingParams(max_tokens=200, stop=(stop, "never-appears")))
    streamed = "".join(e.text for e in events)
    assert streamed == full[: full.find(stop)] == seq.output_text()
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop
    # The token that completed the stop string is reported as generated.
    assert stop in TOK.decode(seq.token_ids)
    # Held-back text never leaks a prefix of the stop string early.
    sent = ""
    for e in events[:-1]:
        sent += e.text
        assert len(full[: full.find(stop)]) >= len(sent)


def test_stop_string_not_found_runs_to_length_and_flushes_held_text() -> None:
    seq, events = run(SamplingParams(max_tokens=30, stop=("<never>",)))
    assert events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == TOK.decode(seq.token_ids)


def test_run_to_end_matches_stepping() -> None:
    eos_model = ToyModel(ModelConfig(seed=0, eos_rate=0.02, tie_rate=0.2, chip_seed=3), TOK)
    for params in (
        SamplingParams(max_tokens=300),
        SamplingParams(max_tokens=300, ignore_eos=True),
        SamplingParams(max_tokens=300, stop=("th",)),
        SamplingParams(max_tokens=50, temperature=0.8, seed=1),
    ):
        stepped = Sequence(eos_model, PROMPT, params)
        while not stepped.finished:
            stepped.step()
        fast = Sequence(eos_model, PROMPT, params)
        fast.run_to_end()
        assert fast.token_ids == stepped.token_ids
        assert fast.finish_reason == stepped.finish_reason
        assert fast.output_text() == stepped.output_text()


def test_min_tokens_suppresses_eos_and_early_stop_strings() -> None:
    eos_model = ToyModel(ModelConfig(seed=0, eos_rate=0.05), TOK)
    free = Sequence(eos_model, PROMPT, SamplingParams(max_tokens=500))
    free.run_to_end()
    first_eos = len(free.token_ids)
    held = Sequence(eos_model, PROMPT, SamplingParams(max_tokens=500, min_tokens=first_eos + 5))
    held.run_to_end()
    assert held.token_ids[: first_eos - 1] == free.token_ids[:-1]
    assert len(held.token_ids) >= first_eos + 5
    full, stop = _stop_inside_output()
    late = run(SamplingParams(max_tokens=200, stop=(stop,), min_tokens=150))[0]
    assert len(late.token_ids) >= 150
    assert len(late.output_text()) > full.find(stop)  # the early occurrence did not stop it

"""The pure parts of the sim's LoRA adapters, as vLLM 0.32 has them: the registry's checks,
adapter_config.json's, the engine's LRU of loaded adapters, the batch's max_loras rule,
vllm:lora_requests_info's labels, the flags, the model under an adapter and the KV cache's
per-adapter blocks (sim.lora, sim.admission, sim.model, sim.kvcache)."""

from __future__ import annotations

import json

import pytest

from sim.admission import Admission
from sim.config import LoraModule
from sim.kv_wire import BlockStored
from sim.kvcache import LoraTag, PrefixCache
from sim.lora import (
    Adapter,
    AdapterCache,
    LoraRequestStates,
    Registry,
    check_config,
    not_found,
    parse_lora_modules,
    sanitized,
    weights_identity,
)
from sim.lora_cli import runtime_lora_updating
from sim.model import ModelConfig, ToyModel
from sim.protocol import ApiError
from sim.tokenizer import build_tokenizer
from tests.factories import greedy, sim_config


def adapter(name: str, int_id: int, *, identity: int = 7, inplace: bool = False) -> Adapter:
    return Adapter(name, int_id, f"/adapters/{name}", identity, "toy", inplace)


# -- the registry -----------------------------------------------------------------------
def refusal(call: object, *args: object) -> tuple[int, str, str]:
    with pytest.raises(ApiError) as err:
        call(*args)  # type: ignore[operator]
    return err.value.status, err.value.type, err.value.message


def test_a_load_is_checked_in_vllms_order_and_words() -> None:
    reg = Registry("toy")
    assert refusal(reg.check_load, "", "/p", False) == (
        400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
    assert refusal(reg.check_load, "a", "", False)[0] == 400
    assert refusal(reg.check_load, "toy", "/p", False) == (
        400, "InvalidUserInput", "The lora adapter 'toy' conflicts with a served base model.")
    reg.add(adapter("a", reg.id_for("a")))
    assert refusal(reg.check_load, "a", "/p", False) == (
        400, "InvalidUserInput",
        "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
        "place, set 'load_inplace' to True.")
    reg.check_load("a", "/p", True)  # in place: allowed
    reg.check_load("b", "/p", False)
    assert refusal(reg.check_unload, "") == (
        400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
    assert refusal(reg.check_unload, "b") == (
        404, "NotFoundError", "The lora adapter 'b' cannot be found.")  # fmt: skip


def test_ids_count_from_1_and_a_reload_in_place_keeps_its_id() -> None:
    reg = Registry("toy")
    a = adapter("a", reg.id_for("a"))
    reg.add(a)
    reg.add(adapter("b", reg.id_for("b")))
    assert (a.int_id, reg.id_for("a"), reg.id_for("c")) == (1, 1, 3)
    reg.remove("a")
    assert reg.id_for("a") == 4  # unloaded: a new load is a new adapter to the engine
    assert [x.name for x in reg.adapters()] == ["b"]


def test_kv_key_and_identity_are_the_same_in_every_process() -> None:
    # Fixed values: str hashes are salted per process, these must not be.
    assert weights_identity(b"{}", b"w") == weights_identity(b"{}", b"w")
    assert weights_identity(b"{}", b"w") != weights_identity(b"{}", b"v")
    assert weights_identity(b"{}w", b"") != weights_identity(b"{}", b"w")
    assert adapter("a", 1).kv_key == adapter("a", 9).kv_key  # name and path, not the id
    assert adapter("a", 1).kv_key != adapter("b", 1).kv_key
    assert weights_identity(b"x", b"y") == 1265508021216752478


# -- adapter_config.json ----------------------------------------------------------------
GOOD = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"lora_alpha": 16, "target_modules": []},
         "Missing required configuration fields: {'r'}"),
        ({}, "Missing required configuration fields: {'lora_alpha', 'r', 'target_modules'}"),
        ({**GOOD, "r": 0}, "LoRA rank `r` must be a positive integer, got 0."),
        ({**GOOD, "r": 32}, "LoRA rank 32 is greater than max_lora_rank 16."),
        ({**GOOD, "rank_pattern": {"q_proj": 64}},
         "LoRA rank 64 is greater than max_lora_rank 16."),
        ({**GOOD, "bias": "all"}, "Adapter bias is not supported."),
        ({**GOOD, "use_dora": True, "bias": "lora_only"},
         "vLLM does not yet support DoRA. Adapter bias is not supported."),
    ],
)  # fmt: skip
def test_configs_vllm_refuses(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_config(json.dumps(config).encode(), 16)
    assert str(err.value) == message


def test_a_good_config_passes_and_garbage_does_not() -> None:
    check_config(json.dumps(GOOD).encode(), 16)
    check_config(json.dumps({**GOOD, "r": 64}).encode(), 64)
    with pytest.raises(ValueError):
        check_config(b"not json", 16)


def test_paths_in_messages_are_sanitized_as_vllm_does() -> None:
    e = not_found("a", "/tmp/pytest-1/adapters/a")
    assert (e.status, e.type) == (404, "NotFoundError")
    assert e.message == "Loading lora a failed: No adapter found for <path>"
    assert sanitized("see /data/x/model.bin now") == "see <path> now"
    assert sanitized("relative/dir stays") == "relative/dir stays"


# -- the engine's loaded adapters ----------------------------------------------------------
def test_the_least_recently_used_adapter_is_evicted() -> None:
    cache = AdapterCache(2)
    a, b, c = adapter("a", 1), adapter("b", 2), adapter("c", 3)
    assert cache.add(a) and cache.add(b)
    assert not cache.add(a)  # loaded: a touch, no cost
    assert cache.add(c)  # full: b, the least recent, goes
    assert cache.loaded == [1, 3]
    assert cache.start(b)  # evicted: a request loads it again (evicting a)
    assert cache.loaded == [3, 2]


def test_an_adapter_with_a_running_request_is_never_evicted() -> None:
    cache = AdapterCache(2)
    a, b, c = adapter("a", 1), adapter("b", 2), adapter("c", 3)
    cache.start(a)  # runs long
    cache.add(b)
    cache.add(c)  # a is least recent but running: b goes
    assert cache.loaded == [1, 3]
    cache.finish(a)
    assert cache.loaded == [3, 1]  # its last step touched it


def test_an_adapter_loaded_in_place_reloads_for_every_request() -> None:
    cache = AdapterCache(2)
    a = adapter("a", 1, inplace=True)
    assert cache.add(a, force=True)
    assert cache.start(a) and cache.start(a)
    assert cache.loaded == [1]


# -- the batch ---------------------------------------------------------------------------
def test_a_request_for_one_adapter_too_many_waits_and_is_skipped() -> None:
    adm: Admission[str] = Admission(slots=8, max_loras=1)
    assert adm.try_take(1)  # adapter 1 runs
    assert adm.try_take(1) and adm.try_take(None)  # its own adapter, the base: run
    assert not adm.try_take(2)
    adm.wait(2, "b")
    adm.wait(None, "base")  # behind it, but waits only if there is no slot
    assert adm.give(None) == ["base"]  # b is skipped: adapter 1 still runs
    assert adm.waiting == 1 and adm.running_adapters == {1}
    assert adm.give(1) == []
    assert adm.give(1) == ["b"]  # adapter 1's last request ended
    assert adm.running_adapters == {2} and adm.waiting == 0


def test_slots_are_taken_in_arrival_order_and_a_cancelled_waiter_leaves() -> None:
    adm: Admission[str] = Admission(slots=1)
    assert adm.try_take(None) and not adm.try_take(None)
    for w in ("x", "y", "z"):
        adm.wait(None, w)
    assert adm.cancel("y") and not adm.cancel("y")
    assert adm.give(None) == ["x"]
    assert adm.give(None) == ["z"]
    assert not adm.cancel("z")  # admitted: the caller gives its place back


# -- vllm:lora_requests_info --------------------------------------------------------------
def test_both_labels_list_every_adapter_with_a_live_request() -> None:
    states = LoraRequestStates()
    assert states.labels() == ("", "")
    states.running("b", 1)
    states.running("a", 2)
    states.running("b", 3)
    assert states.labels() == ("b,a", "b,a")  # vLLM 0.32 fills both dicts the same
    states.finished("b", 1)
    states.finished("x", 9)  # never seen (it ended before its first output): nothing
    assert states.labels() == ("b,a", "b,a")
    states.finished("b", 3)
    assert states.labels() == ("a", "a")


# -- flags ----------------------------------------------------------------------------------
def test_lora_is_off_unless_enabled_and_takes_vllms_defaults() -> None:
    assert sim_config().lora is None
    lora = sim_config("--enable-lora").lora
    assert lora is not None
    assert (lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == (1, 1, 16)
    assert lora.load_s == pytest.approx(0.15)
    assert sim_config("--enable-lora", "--instant").lora.load_s == 0.0  # type: ignore[union-attr]
    lora = sim_config("--enable-lora", "--max-loras", "3", "--lora-load-ms", "20").lora
    assert lora is not None and lora.max_cpu_loras == 3 and lora.load_s == pytest.approx(0.02)


def test_bad_lora_flags_refuse_to_start() -> None:
    with pytest.raises(SystemExit, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        sim_config("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1")
    with pytest.raises(SystemExit, match="needs --enable-lora"):
        sim_config("--lora-modules", "a=/x")
    with pytest.raises(SystemExit, match="Invalid JSON format"):
        sim_config("--enable-lora", "--lora-modules", "{oops")


def test_lora_modules_take_both_of_vllms_forms() -> None:
    assert parse_lora_modules(["a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "toy"}',
                               ""]) == (LoraModule("a", "/x/a"), LoraModule("b", "/x/b", "toy"))
    with pytest.raises(ValueError, match="Invalid fields"):
        parse_lora_modules(['{"name": "b"}'])


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("true", True), (" TRUE ", True), ("0", False),
                      ("yes", False), ("", False), (None, False)],
)  # fmt: skip
def test_runtime_updating_is_vllms_reading_of_the_variable(value: str | None, on: bool) -> None:
    env = {} if value is None else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
    assert runtime_lora_updating(env) is on


# -- the model under an adapter ------------------------------------------------------------
PROMPT = [1, 40, 41, 42, 43]


@pytest.mark.parametrize("byte_level", [False, True])
def test_an_adapter_changes_the_output_and_resume_stays_exact(byte_level: bool) -> None:
    base = ToyModel(ModelConfig(), build_tokenizer(0, byte_level=byte_level))
    a, b = base.with_adapter(1), base.with_adapter(2)
    out = {m: greedy(m, PROMPT, 24, ignore_eos=True) for m in (base, a, b)}
    assert len({tuple(v) for v in out.values()}) == 3
    assert greedy(base.with_adapter(1), PROMPT, 24, ignore_eos=True) == out[a]
    for k in (1, 7, 23):  # the first k generated ids come back as prompt: same continuation
        assert greedy(a, PROMPT + out[a][:k], 24 - k, ignore_eos=True) == out[a][k:]
    assert greedy(base, PROMPT, 24, ignore_eos=True) == out[base]  # the base is untouched


# -- KV blocks under an adapter -------------------------------------------------------------
def test_the_same_prompt_under_two_adapters_shares_no_block() -> None:
    cache = PrefixCache(capacity_blocks=64, block_size=4, events=True)
    prompt = list(range(12))
    a, b = LoraTag(key=11, lora_id=1, name="a"), LoraTag(key=22, lora_id=2, name="b")
    cache.open(prompt, [], a).close()
    assert cache.lookup(prompt, a).hit_tokens == 11
    assert cache.lookup(prompt, b).hit_tokens == 0
    assert cache.lookup(prompt).hit_tokens == 0
    cache.open(prompt, [], None).close()
    assert cache.lookup(prompt).hit_tokens == 11
    events = cache.take_events()
    under_a, plain = [e for e in events if isinstance(e, BlockStored)]
    assert len(events) == 2
    assert (under_a.lora_id, under_a.lora_name) == (1, "a")
    assert under_a.extra_keys == [("a",)] * 3
    assert (plain.lora_id, plain.lora_name, plain.extra_keys) == (None, None, [None] * 3)
    assert not set(under_a.block_hashes) & set(plain.block_hashes)

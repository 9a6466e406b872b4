import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.prefix import BlockHasher, PromptError, chat_key, completion_key, hash_text, hash_token_ids
from kvroute.prefix.keys import estimate_tokens

texts = st.text(min_size=0, max_size=400)


@given(st.lists(st.tuples(texts, texts), min_size=1, max_size=6), texts)
def test_next_turn_extends_previous_key(turns, new_question):
    messages = [{"role": "system", "content": "be brief"}]
    for question, answer in turns:
        messages.append({"role": "user", "content": question})
        before = chat_key(messages)
        messages.append({"role": "assistant", "content": answer})
        after = chat_key(messages + [{"role": "user", "content": new_question}])
        assert after.startswith(before)


@settings(max_examples=50)
@given(st.lists(st.tuples(texts, texts), min_size=1, max_size=5), texts)
def test_next_turn_extends_previous_block_hashes(turns, question):
    messages = []
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    h1 = hash_text(chat_key(messages), 4)
    h2 = hash_text(chat_key(messages + [{"role": "user", "content": question}]), 4)
    assert h2[: len(h1)] == h1


def test_content_parts_and_text_are_the_same_prefix_family():
    a = chat_key([{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    b = chat_key([{"role": "user", "content": "hello"}])
    assert a == b


@pytest.mark.parametrize("messages, field", [
    ([], "messages"), (None, "messages"), ("hi", "messages"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "video"}]}], "messages[0].content[0].type"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(PromptError, match=field.replace("[", r"\[").replace("]", r"\]")):
        chat_key(messages)


def test_completion_keys():
    assert completion_key("abc") == "abc"
    assert completion_key([1, 2, 3]) == [1, 2, 3]
    assert completion_key(["first", "second"]) == "first"
    for bad in ("", [], None, 3, [True]):
        with pytest.raises(PromptError, match="prompt"):
            completion_key(bad)


def test_chained_hashes_cover_the_prefix():
    base = "x" * 1024
    a = hash_text(base + "A" * 256, block_tokens=64)  # 256-byte blocks
    b = hash_text(base + "B" * 256, block_tokens=64)
    assert len(a) == len(b) == 5
    assert a[:4] == b[:4] and a[4] != b[4]
    # a change in block 0 changes every later hash, even where the bytes agree
    c = hash_text("y" + base[1:] + "A" * 256, block_tokens=64)
    assert all(x != y for x, y in zip(a, c))


def test_only_full_blocks_are_hashed_and_tokens_estimated():
    assert hash_text("z" * 255, 64) == ()
    assert len(hash_text("z" * 256, 64)) == 1
    assert estimate_tokens("abcd") == 1 and estimate_tokens("abcde") == 2


def test_token_id_hashing_and_hasher():
    ids = list(range(200))
    assert len(hash_token_ids(ids, 64)) == 3
    hashes, tokens = BlockHasher(64)(ids)
    assert tokens == 200 and hashes == hash_token_ids(ids, 64)
    hashes, tokens = BlockHasher(16)("q" * 640)
    assert tokens == 160 and len(hashes) == 10


def test_tokenizer_path_must_be_local_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        BlockHasher(tokenizer_path=str(tmp_path / "missing.json"))


def test_local_tokenizer_json_gives_exact_token_blocks(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the cache router prefix keeps warm".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hasher = BlockHasher(block_tokens=4, tokenizer_path=str(path))
    hashes, tokens = hasher("the cache router keeps the prefix warm the cache")
    assert tokens == 9 and len(hashes) == 2  # exact token count, two full blocks of four ids
    longer, _ = hasher("the cache router keeps the prefix warm the cache router keeps warm")
    assert longer[:2] == hashes
    assert hashes == hash_token_ids(tok.encode("the cache router keeps the prefix warm the cache").ids, 4)


def test_text_spans_cut_blocks_of_a_fractional_byte_length():
    """An engine's cache block of whole engine tokens is a fractional number of bytes (here 2.5):
    the spans alternate 2 and 3 bytes, equal prefixes give equal hashes, and only full blocks
    count."""
    from kvroute.prefix.blocks import hash_text_spans

    a = hash_text_spans("abcdefghij", 2.5)
    assert len(a) == 4 and len(hash_text_spans("abcdefghi", 2.5)) == 3
    assert hash_text_spans("abcdefghijXYZ", 2.5)[:4] == a and hash_text_spans("abcdeXghij", 2.5)[:2] == a[:2]
    assert hash_text_spans("abcdeXghij", 2.5)[2] != a[2]
    with pytest.raises(ValueError):
        hash_text_spans("abc", 0.5)

import pytest

from gemmdrift.errors import GemmdriftError
from gemmdrift.schedules import parse_schedule


def test_parse_round_trips_canonical_text():
    for text in ["decode", "verify:2", "prefill:512", "prefill:512,verify:2", "prefill:512@448,verify:2@64,decode"]:
        assert parse_schedule(text).text == text


def test_decode_is_one_token_per_pass():
    assert parse_schedule("decode").blocks(4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_verify_k_feeds_blocks_of_k_plus_one_and_a_short_tail():
    assert parse_schedule("verify:2").blocks(7) == [(0, 3), (3, 6), (6, 7)]


def test_two_phases_split_at_the_prompt_boundary():
    blocks = parse_schedule("prefill:4,verify:2").blocks(10, split=5)
    assert blocks == [(0, 4), (4, 5), (5, 8), (8, 10)]


def test_explicit_lengths_cover_consecutive_spans():
    s = parse_schedule("prefill:3@4,verify:1@4,decode")
    assert s.blocks(10) == [(0, 3), (3, 4), (4, 6), (6, 8), (8, 9), (9, 10)]


def test_blocks_cover_every_token_exactly_once():
    for text, split in [("prefill:512,decode", 600), ("prefill:7,verify:3", 11), ("prefill:2048", None)]:
        blocks = parse_schedule(text).blocks(700, split)
        covered = [t for a, b in blocks for t in range(a, b)]
        assert covered == list(range(700))


@pytest.mark.parametrize("text", ["", "verify", "verify:0", "prefill:-1", "prefill:0", "foo", "decode:3",
                                  "prefill:4,,decode", "verify:2@0", "prefill:x"])
def test_bad_schedules_are_user_errors(text):
    with pytest.raises(GemmdriftError):
        parse_schedule(text)


def test_two_phases_need_a_split_inside_the_stream():
    s = parse_schedule("prefill:512,decode")
    for split in (None, 0, 10):
        with pytest.raises(GemmdriftError):
            s.blocks(10, split)


def test_three_phases_need_lengths():
    with pytest.raises(GemmdriftError):
        parse_schedule("prefill:4,verify:2,decode").blocks(20, split=5)


def test_lengths_must_fit_the_stream():
    with pytest.raises(GemmdriftError):
        parse_schedule("prefill:4@30,decode").blocks(20)
    with pytest.raises(GemmdriftError):
        parse_schedule("prefill:4@5,decode@5").blocks(20)

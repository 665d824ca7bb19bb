"""Stop strings over streamed text: caught across deltas, never partly shown, earliest wins."""

import pytest

from splitserve.platform.engine.stop import StopStringMatcher
from splitserve.platform.errors import InvalidRequestError

# (stops, include_stop_str_in_output, deltas, expected (emitted, stopped) per feed, flush, matched)
CASES = {
    "no stop: the held prefix is flushed": (
        ("STOP",),
        False,
        ["Hello ", "wor", "ld ST"],
        [("Hello ", False), ("wor", False), ("ld ", False)],
        "ST",
        None,
    ),
    "stop split over three deltas": (
        ("<end>",),
        False,
        ["abc<", "en", "d>tail"],
        [("abc", False), ("", False), ("", True)],
        "",
        "<end>",
    ),
    "stop split, included": (
        ("<end>",),
        True,
        ["abc<", "en", "d>tail"],
        [("abc", False), ("", False), ("<end>", True)],
        "",
        "<end>",
    ),
    "stop inside one delta": (("\n\n",), False, ["one\n\ntwo"], [("one", True)], "", "\n\n"),
    "stop at the very start": (("###",), False, ["###", "more"], [("", True), ("", True)], "", "###"),
    "stop at the very start, included": (("###",), True, ["###rest"], [("###", True)], "", "###"),
    "stop completes a held prefix": (
        ("STOP",),
        False,
        ["go ST", "OP? no: STAR", "T"],
        [("go ", False), ("", True)],
        "",
        "STOP",
    ),
    "partial match that breaks is emitted": (
        ("STOP",),
        False,
        ["go ST", "AR", "T"],
        [("go ", False), ("STAR", False), ("T", False)],
        "",
        None,
    ),
    "earliest ending stop wins": (("abcd", "bc"), False, ["xab", "cd"], [("x", False), ("a", True)], "", "bc"),
    "same end: earliest start wins": (("bc", "abc"), True, ["xabc"], [("xabc", True)], "", "abc"),
    "earliest of several in one delta": (("END", "\n"), False, ["a\nbEND"], [("a", True)], "", "\n"),
    "longest held prefix across stops": (
        ("xyz", "yzw"),
        False,
        ["ab xy", "z"],
        [("ab ", False), ("", True)],
        "",
        "xyz",
    ),
    "overlapping self-prefix": (("aab",), False, ["aaa", "ab"], [("a", False), ("a", True)], "", "aab"),
    "no stop strings at all": ((), False, ["any", "thing"], [("any", False), ("thing", False)], "", None),
    "unicode stop": (("。",), False, ["你好", "。再见"], [("你好", False), ("", True)], "", "。"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_stop_string_matching(name):
    stops, include, deltas, expected, flushed, matched = CASES[name]
    matcher = StopStringMatcher(stops, include)
    assert [matcher.feed(delta) for delta in deltas[: len(expected)]] == expected
    assert matcher.flush() == flushed
    assert matcher.matched_stop == matched
    assert matcher.stopped == (matched is not None)


@pytest.mark.parametrize("text", ["hello <|stop|> world", "<|stop|>", "cut <|sto", "<<|stop|>", "plain text <|"])
@pytest.mark.parametrize("include", [True, False])
def test_result_does_not_depend_on_how_text_is_cut(text, include):
    def run(deltas):
        matcher = StopStringMatcher(("<|stop|>", "|s"), include)
        out = ""
        for delta in deltas:
            emitted, stopped = matcher.feed(delta)
            out += emitted
            if stopped:
                return out, matcher.matched_stop
        return out + matcher.flush(), None

    whole = run([text])
    assert run(list(text)) == whole
    assert run([text[i : i + 3] for i in range(0, len(text), 3)]) == whole
    if "|s" in text:  # "|s" completes before "<|stop|>" does
        assert whole == (text[: text.index("|s")] + ("|s" if include else ""), "|s")


@pytest.mark.parametrize("stops", [("",), ("ok", ""), (None,)])
def test_empty_stop_strings_are_rejected(stops):
    with pytest.raises(InvalidRequestError, match="non-empty strings"):
        StopStringMatcher(stops, False)

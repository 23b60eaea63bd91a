"""The C Criteo kernels (data/criteo/native.py) against the numpy code they replace: parse.py's
parse_lines, Vocabulary.map and np.unique, on random and malformed input."""

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_hybrid.data.criteo import native, parse
from dlrm_hybrid.data.criteo.vocabulary import Vocabulary

needs_library = pytest.mark.skipif(not native.available(), reason="csrc/criteo.c not built")
FIELDS = ("labels", "dense", "cats", "skipped", "crlf", "short")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_install_builds_the_library_where_a_c_compiler_exists():
    assert native.available()


# (valid, malformed) values of the label, integer and categorical fields
LABELS = (["0", "1"], ["", "2", "01", "-1", "1\r"])
INTEGERS = (["", "0", "7", "-5", "-0", "65535", "65536", "9" * 18, "-" + "9" * 17, "4294967296"],
            ["-", "--5", "5-", "1a", " 3", "1" * 19, "-" + "9" * 18])
HEX = (["", "0123abcd", "ABCDEF09", "fFfFfFfF", "00000000", "ffffffff"],
       ["0123abc", "0123abcde", "0123abcg", "0123 bcd", "0123ab-d", "0123ab\xe9d", "0x23abcd"])
NOISE = np.frombuffer(b"\t\r01-9aF g", np.uint8)


def criteo_text(seed: int, lines: int) -> bytes:
    """Lines mostly of 40 fields, some short or long, some cut after a field (what stripping
    trailing whitespace leaves), blank ones, CRLF ends, and bytes at random; one field in 50
    malformed."""
    rng, out = np.random.default_rng(seed), []

    def field(values):
        return rng.choice(values[rng.random() < 0.02])

    for _ in range(lines):
        kind = rng.choice(["full", "full", "full", "short", "count", "blank", "noise"])
        count = {"full": 40, "short": rng.integers(1, 40)}.get(kind, rng.integers(1, 43))
        fields = [field(LABELS)] + [field(INTEGERS) for _ in range(13)]
        fields = (fields + [field(HEX) for _ in range(max(count - 14, 26))])[:count]
        line = "\t".join(fields) if kind in ("full", "short", "count") else ""
        if kind == "noise":
            line = NOISE[rng.integers(0, len(NOISE), rng.integers(0, 60))].tobytes().decode()
        out.append(line + rng.choice(["\n", "\n", "\r\n"]))
    return "".join(out).encode("latin-1")


def assert_same_chunk(data: bytes, pad_short: bool) -> None:
    want, got = parse.parse_lines(data, pad_short), native.parse_lines(data, pad_short)
    for field in FIELDS:
        a, b = getattr(want, field), getattr(got, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert a.tobytes() == b.tobytes(), field  # bit for bit (float16 bits, NaN or not)


@needs_library
@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 30), st.booleans())
def test_parse_lines_equals_numpy_on_malformed_text(seed, lines, pad_short):
    data = criteo_text(seed, lines)
    assert_same_chunk(data, pad_short)


@needs_library
def test_parse_lines_equals_numpy_on_criteo_shaped_text_with_large_integers():
    """Integers from 0 to 10^18 (the C table covers those below 2^16; the rest are computed in
    numpy, here more of them than one a line, so the parser runs again with room for all)."""
    rng = np.random.default_rng(0)
    rows = 2000
    integers = (10 ** rng.uniform(0, 18, (rows, 13))).astype(np.int64)
    integers[rng.random((rows, 13)) < 0.1] *= -1
    cats = rng.integers(0, 2**32, (rows, 26))
    lines = ["\t".join([str(rng.integers(2)), *(str(v) if rng.random() > 0.2 else "" for v in i),
                        *(f"{v:08x}" if rng.random() > 0.1 else "" for v in c)])
             for i, c in zip(integers, cats)]
    data = ("\n".join(lines) + "\n").encode()
    assert_same_chunk(data, False)
    assert (native.parse_lines(data).dense > np.float16(11.1)).sum() > 2 * rows


@needs_library
def test_parse_lines_ignores_text_after_the_last_newline_as_numpy_does():
    assert_same_chunk(criteo_text(3, 20) + b"1\t2\t3", True)


@needs_library
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 3000), min_size=26, max_size=26))
def test_id_lookup_equals_the_vocabularys_numpy_map(seed, sizes):
    """Values held and not, -1, and empty tables; tables of int64 or uint32 values."""
    rng = np.random.default_rng(seed)
    vocabulary = Vocabulary([rng.choice(2**32, n, replace=False).astype(np.uint32)
                             for n in sizes])
    values, ids = zip(*vocabulary.lookup_tables())
    if seed % 2:
        values = [v.astype(np.int64) for v in values]
    n = 500
    cats = rng.integers(-1, 2**32, (n, 26))
    held = rng.random((n, 26)) < 0.7
    for f in range(26):
        if sizes[f]:
            cats[held[:, f], f] = rng.choice(values[f], held[:, f].sum())
    cats[rng.random((n, 26)) < 0.1] = -1
    assert np.array_equal(native.IdLookup(list(values), list(ids)).map(cats),
                          vocabulary.map(cats))


def unique_keys(cats: np.ndarray):
    keys = (cats << 5 | np.arange(26))[cats >= 0].astype(np.uint64)
    return np.unique(keys, return_counts=True)


@needs_library
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 400), st.sampled_from([3, 100, 2**32]))
def test_key_counter_equals_np_unique(seed, rows, vocabulary):
    rng = np.random.default_rng(seed)
    cats = rng.integers(0, vocabulary, (rows, 26))
    cats[rng.random((rows, 26)) < 0.2] = -1
    counter = native.KeyCounter(rows * 26)
    half = rows // 2
    assert counter.add(cats[:half]) and counter.add(cats[half:])
    want_keys, want_counts = unique_keys(cats)
    assert counter.size == len(want_keys)
    keys, counts = counter.drain()
    assert keys.dtype == counts.dtype == np.uint64
    assert np.array_equal(keys, want_keys) and np.array_equal(counts, want_counts)
    assert counter.size == 0 and len(counter.drain()[0]) == 0  # drained empties it


@needs_library
def test_key_counter_refuses_what_might_not_fit_and_adds_nothing():
    rng = np.random.default_rng(1)
    first, second = rng.integers(-1, 50, (30, 26)), rng.integers(-1, 50, (30, 26))
    counter = native.KeyCounter(len(unique_keys(first)[0]) + int((second >= 0).sum()) - 1)
    assert counter.add(first)
    assert not counter.add(second)
    keys, counts = counter.drain()
    assert np.array_equal(keys, unique_keys(first)[0]) and counts.sum() == (first >= 0).sum()
    assert counter.add(second)  # once drained, it fits
    assert np.array_equal(counter.drain()[1], unique_keys(second)[1])
    with pytest.raises(ValueError, match="can never fit"):
        native.KeyCounter(10).add(first)
    with pytest.raises(ValueError, match=r"\[0, 2\^32\)"):
        native.KeyCounter(100).add(np.full((1, 26), 2**32))

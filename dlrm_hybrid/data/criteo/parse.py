"""Parsing Criteo TSV text: `label \\t I1..I13 \\t C1..C26` lines into labels, log-transformed
numericals and categorical values, with each malformed line's kind (`KINDS`).

- Numericals: missing -> 0.0; otherwise negatives clamped to 0, then log(x + 3); stored float16.
  More than 18 characters is `bad_numeric`.
- Categoricals: the 8-hex-digit value as an integer, -1 where missing.
- Malformed lines are counted by kind and skipped, except `crlf`: it counts lines ending in
  \\r\\n (whatever else is wrong with them) and keeps the row.
- Rows short only by trailing fields (fewer than 40, the last not empty, valid once the missing
  ones are read as empty: what stripping trailing whitespace leaves of rows ending in empty
  fields) are wrong_field_count unless `pad_short`, which keeps them with those fields empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

NUM_NUMERICAL, NUM_CATEGORICAL = 13, 26
NUM_FIELDS = 1 + NUM_NUMERICAL + NUM_CATEGORICAL
KINDS = ("wrong_field_count", "bad_label", "bad_numeric", "bad_category", "crlf", "blank_line")
WRONG_FIELD_COUNT, BAD_LABEL, BAD_NUMERIC, BAD_CATEGORY, CRLF, BLANK_LINE = range(len(KINDS))
REASONS = {
    "wrong_field_count": f"not {NUM_FIELDS} tab-separated fields (label, I1..I13, C1..C26)",
    "bad_label": "label is not 0 or 1",
    "bad_numeric": "an integer field (I1..I13) is not an integer of at most 18 characters",
    "bad_category": "a categorical field (C1..C26) is not empty or 8 hex digits",
    "crlf": "line ends with \\r\\n",
    "blank_line": "blank line",
}
MAX_DIGITS, HEX_DIGITS = 18, 8
TAB, NEWLINE, CR, MINUS, ZERO, ONE = 9, 10, 13, 45, 48, 49


@dataclass
class Chunk:
    """Parsed lines: the rows kept, per line why it was skipped (-1: kept) and whether it ended
    in \\r\\n, and the field counts of the lines short only by trailing fields."""
    labels: np.ndarray  # [n] uint8
    dense: np.ndarray  # [n, 13] float16
    cats: np.ndarray  # [n, 26] int64 hex values, -1 where missing
    skipped: np.ndarray  # [lines] int8 index into KINDS, -1 for kept rows
    crlf: np.ndarray  # [lines] bool
    short: np.ndarray  # [lines short only by trailing fields] their field counts

    @property
    def lines(self) -> int:
        return len(self.skipped)

    def bad_counts(self) -> np.ndarray:
        counts = np.bincount(self.skipped[self.skipped >= 0], minlength=len(KINDS))
        counts[CRLF] = self.crlf.sum()
        return counts

    def first_problem(self) -> Optional[Tuple[int, str]]:
        """(line index in the chunk, kind) of the first line with any problem."""
        problem = (self.skipped >= 0) | self.crlf
        if not problem.any():
            return None
        line = int(np.argmax(problem))
        return line, KINDS[self.skipped[line]] if self.skipped[line] >= 0 else "crlf"


def parse_lines(data: bytes, pad_short: bool = False) -> Chunk:
    """Parse newline-terminated lines without a Python loop over them: every tab or newline ends
    a field, so field k spans (seps[k-1], seps[k]) and a line's fields are the seps before its
    newline. A line of fewer fields whose last one is not empty is what a tool that strips
    trailing whitespace leaves of a row ending in empty fields: it is parsed with the missing
    fields empty, kept with `pad_short` when it parses, else counted as wrong_field_count."""
    buf = np.frombuffer(data, np.uint8)
    seps = np.flatnonzero((buf == TAB) | (buf == NEWLINE))
    line_end = np.flatnonzero(buf[seps] == NEWLINE)  # index into seps of each line's newline
    fields = np.diff(line_end, prepend=-1)
    starts, ends = np.r_[0, seps[:-1] + 1], seps.copy()
    crlf = buf[seps[line_end] - 1] == CR  # never the previous line's newline: that is not CR
    ends[line_end[crlf]] -= 1
    last_empty = ends[line_end] == starts[line_end]
    skipped = np.where(fields == NUM_FIELDS, -1, WRONG_FIELD_COUNT).astype(np.int8)
    skipped[(fields == 1) & last_empty] = BLANK_LINE
    rows = np.flatnonzero((fields == NUM_FIELDS) | (fields < NUM_FIELDS) & ~last_empty)
    count = fields[rows, None]
    index = line_end[rows, None] + np.arange(1 - NUM_FIELDS, 1)  # 40 fields ending at the newline
    short = count[:, 0] < NUM_FIELDS
    if short.any():  # field j of each line; fields past its end are empty, at its newline
        index = np.minimum(index + NUM_FIELDS - count, line_end[rows, None])
    s, e = starts[index], ends[index]
    if short.any():
        s = np.where(np.arange(NUM_FIELDS) < count, s, e)
    label_ok = (e[:, 0] - s[:, 0] == 1) & ((buf[s[:, 0]] == ZERO) | (buf[s[:, 0]] == ONE))
    dense, dense_ok = _parse_numerical(buf, s[:, 1:1 + NUM_NUMERICAL], e[:, 1:1 + NUM_NUMERICAL])
    cats, cats_ok = _parse_hex(buf, s[:, 1 + NUM_NUMERICAL:], e[:, 1 + NUM_NUMERICAL:])
    why = np.select([~label_ok, ~dense_ok, ~cats_ok], [BAD_LABEL, BAD_NUMERIC, BAD_CATEGORY], -1)
    padded = short & (why < 0)  # short only by trailing fields
    why[short & ~(padded & pad_short)] = WRONG_FIELD_COUNT
    skipped[rows] = why
    keep = why < 0
    return Chunk(buf[s[keep, 0]] - ZERO, dense[keep], cats[keep], skipped, crlf,
                 count[padded, 0])


def _parse_numerical(buf: np.ndarray, s: np.ndarray, e: np.ndarray) -> Tuple[np.ndarray, ...]:
    """I1..I13 as float16 log(max(x, 0) + 3), 0 where empty; and per row whether all parsed."""
    length = e - s
    negative = (length > 1) & (buf[s] == MINUS)
    ok = length <= MAX_DIGITS
    value = np.zeros(s.shape, np.int64)
    for j in range(min(int(length.max(initial=0)), MAX_DIGITS)):
        digit = buf[np.minimum(s + j, len(buf) - 1)].astype(np.int64) - ZERO
        inside, is_digit = j < length, (digit >= 0) & (digit <= 9)
        ok &= ~inside | is_digit | (negative & (j == 0))
        value = np.where(inside & is_digit, value * 10 + digit, value)
    dense = np.where(length == 0, 0.0, np.log(np.where(negative, 0, value) + 3.0))
    return dense.astype(np.float16), ok.all(axis=1)


def _parse_hex(buf: np.ndarray, s: np.ndarray, e: np.ndarray) -> Tuple[np.ndarray, ...]:
    """C1..C26 as int64 values, -1 where empty; and per row whether all were empty or 8 hex
    digits. Each field's 8 bytes are read as one uint64 and decoded with bit arithmetic (SWAR):
    several times faster than a numpy pass per digit."""
    length = e - s
    if len(buf) < HEX_DIGITS:  # a text shorter than one value: room for the 8-byte reads
        buf = np.r_[buf, np.zeros(HEX_DIGITS, np.uint8)]
    every_byte = np.ndarray((max(len(buf) - 7, 0),), "<u8", buf, strides=(1,))
    words = every_byte[np.minimum(s, len(buf) - 8)]  # first character in the lowest byte
    chars = words.view(np.uint8)
    lower = chars | 0x20  # 'A'-'F' -> 'a'-'f'
    is_hex = (chars >= ord("0")) & (chars <= ord("9")) | (lower >= ord("a")) & (lower <= ord("f"))
    all_hex = is_hex.view("<u8").reshape(s.shape) == 0x0101010101010101  # 8 true bytes
    ok = (length == 0) | ((length == HEX_DIGITS) & all_hex)
    nibbles = (words & 0x0F0F0F0F0F0F0F0F) + ((words >> 6) & 0x0101010101010101) * 9  # a-f: +9
    x = nibbles.byteswap()  # first character in the highest byte; pack the 8 nibbles:
    x = (x | (x >> 4)) & 0x00FF00FF00FF00FF
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFF
    x = (x | (x >> 16)) & 0x00000000FFFFFFFF
    return np.where(length == 0, -1, x.astype(np.int64)), ok.all(axis=1)


"""Interaction logs as they come, read into columns: CSV, TSV or `::`-separated rows of
(user, item, [timestamp], [rating or label], [side columns]), and what counts as a positive.

Layouts: MovieLens' rating files are recognised by their content (`known_layout`): ratings.csv
by its header, whatever the file is called; u.data and ratings.dat, which have none, by a name of
theirs and a first line of four numbers in their delimiter. Any other file needs --columns, a
comma list of roles: user, item, timestamp, rating, label, user:NAME or item:NAME (a side feature
of that tower) and _ (a column to ignore), unless its header names them (`header_roles`). A header line (a number column that is not a number,
the roles' own names, or id columns named as ids are: `user_id`, `movieId`, ...) is skipped, and
a UTF-8 byte-order mark dropped; a carriage return alone ends a line in a file without a newline
(classic Mac OS). Fields may be quoted ("a,b"). Ids and side values are kept as
the file's bytes; numbers are float64. A user or item id must be UTF-8 text without a line
separator (users.txt/items.txt hold one id a line): another is a bad row (`bad_id`).

Speed: a clean file is parsed by numpy's C reader (`np.loadtxt`) in one call; only a file it
refuses is read again line by line, to name its first bad line (FILE:LINE) or, with
`skip_bad`, to count and leave out every bad line.
"""

from __future__ import annotations

import csv
import io
import operator
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.errors import DataError, UserError

ROLES = ("user", "item", "timestamp", "rating", "label")
NUMBERS = ("timestamp", "rating", "label")
IGNORED = "_"
MOVIELENS = ("user", "item", "rating", "timestamp")
MOVIELENS_HEADER = ("userId", "movieId", "rating", "timestamp")  # ratings.csv's, any name
HEADERLESS = {"u.data": "\t", "ratings.dat": "::"}  # MovieLens' files without a header
BAD_KINDS = {"wrong_field_count": "{n} fields, the layout has {width} ({columns})",
             "empty_id": "the {what} is empty",
             "bad_number": "the {what} is {value!r}, not a finite number",
             "bad_id": "the {what} {value!r} {why}"}
# str.splitlines() breaks a line at these: an id holding one would split in users.txt/items.txt
LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
# What an id column's header may read (lower case, `_`, `-` and spaces dropped): the role, a
# word for what users or items are, either with `id` after it
ID_NAMES = {"user": ("user", "customer", "visitor", "member", "reader", "viewer", "buyer",
                     "client", "account", "person"),
            "item": ("item", "movie", "product", "article", "video", "song", "track", "artist",
                     "book", "isbn", "asin", "business", "post", "pin", "doc", "document", "news",
                     "title", "sku", "game", "app", "recipe", "anime")}
OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
       ">": operator.gt, "<": operator.lt}
ID_WIDTH = 16  # bytes first tried for an id or side value; a wider one makes the file read again
SEPARATOR = "\x1f"  # stands in for a delimiter of several characters (`::`)
ARCHIVES = {"gzip": b"\x1f\x8b", "zip": b"PK\x03\x04", "xz": b"\xfd7zXZ\x00",
            "zstd": b"\x28\xb5\x2f\xfd"}  # magic numbers no text log starts with
CR = "\ue000"  # stands in for a carriage return inside a line, which csv refuses (never in
# the text: latin-1 decodes to U+0000..U+00FF)


@dataclass
class Log:
    """The rows of one or several files, in file order (which breaks timestamp ties)."""

    columns: Dict[str, np.ndarray]  # role (user:NAME for side columns) -> one value per kept row
    layout: Tuple[str, ...]  # the roles, as --columns spells them
    rows: int = 0  # data rows read: kept + bad
    bad: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(BAD_KINDS, 0))
    sources: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.columns["user"])

    def side(self, tower: str) -> List[str]:
        return [name.split(":", 1)[1] for name in self.layout if name.startswith(f"{tower}:")]


@dataclass(frozen=True)
class Positive:
    """What counts as an engagement: `column op value`, or every row (column "")."""

    column: str = ""
    op: str = ""
    value: float = 0.0

    def __str__(self) -> str:
        return f"{self.column} {self.op} {self.value:g}" if self.column else "every row"

    def mask(self, log: Log) -> np.ndarray:
        if not self.column:
            return np.ones(len(log), bool)
        return OPS[self.op](log.columns[self.column], self.value)


def parse_columns(spec: str) -> Tuple[str, ...]:
    """--columns: the roles of a file's columns, in order."""
    roles = tuple(r.strip() for r in spec.split(","))
    for role in roles:
        side = re.fullmatch(r"(user|item):([A-Za-z0-9_]+)", role)
        if role not in (*ROLES, IGNORED) and not side:
            raise UserError(f"--columns: {role!r} is not a role; use user, item, timestamp, "
                            f"rating, label, user:NAME, item:NAME or _ (ignored)")
        if side and side.group(2) == "id":
            raise UserError(f"--columns: {role} would clash with the tower's own {role[:4]}_id; "
                            f"name it otherwise")
        if role != IGNORED and roles.count(role) > 1:
            raise UserError(f"--columns: {role} is named twice")
    if "user" not in roles or "item" not in roles:
        raise UserError(f"--columns: {spec!r} needs a user and an item column")
    if "rating" in roles and "label" in roles:
        raise UserError("--columns: give a rating or a label column, not both")
    return roles


def parse_positive(rule: Optional[str], layout: Sequence[str]) -> Positive:
    """--positive, e.g. 'rating>=4'; by default rating >= 4, label == 1, or every row."""
    if rule is None:
        return (Positive("rating", ">=", 4.0) if "rating" in layout else
                Positive("label", "==", 1.0) if "label" in layout else Positive())
    match = re.fullmatch(r"\s*(rating|label)\s*(>=|<=|==|!=|>|<)\s*(-?[0-9.]+)\s*", rule)
    if not match:
        raise UserError(f"--positive: {rule!r} is not a rule; write e.g. 'rating>=4' or "
                        f"'label==1' (operators: {' '.join(OPS)})")
    if match.group(1) not in layout:
        raise UserError(f"--positive: the log has no {match.group(1)} column (its columns: "
                        f"{','.join(layout)}); name it in --columns or drop --positive")
    return Positive(match.group(1), match.group(2), float(match.group(3)))


def layout_of(path: str, columns: Optional[Tuple[str, ...]], delimiter: Optional[str]
              ) -> Tuple[Tuple[str, ...], str, Optional[bool]]:
    """(roles, delimiter, header: True/False, or None to detect) of one input file."""
    if columns is not None:
        return columns, delimiter or _sniff(path), None
    known = known_layout(path)
    if known is not None:
        return MOVIELENS, delimiter or known[0], known[1]
    named = header_roles(path, delimiter)
    if named is None:
        raise UserError(f"{path}: not a MovieLens ratings file (ratings.csv's header "
                        f"{','.join(MOVIELENS_HEADER)}, or {' / '.join(HEADERLESS)} rows) and "
                        f"no header of roles; say what its columns are with --columns, e.g. "
                        f"--columns user,item,rating,timestamp")
    return named, delimiter or _sniff(path), True


def header_roles(path: str, delimiter: Optional[str]) -> Optional[Tuple[str, ...]]:
    """The roles a header line names, each column's (`user,item,rating,timestamp`,
    `user_id,item_id,label`, `user,item,item:genre,_`: what --columns would say), or None
    where one column names no role or the roles are not a layout --columns takes."""
    first = _first_line(path)
    sep = delimiter or next((d for d in ("::", "\t", ",", ";", "|") if d in first), None)
    if sep is None:
        return None
    fields = _fields(first.replace(sep, SEPARATOR), SEPARATOR)
    roles = tuple(_role_named(f.strip()) for f in fields)
    if not all(roles):
        return None
    try:
        return parse_columns(",".join(roles))  # type: ignore[arg-type]
    except UserError:  # e.g. no item column, or a rating and a label
        return None


def _role_named(name: str) -> Optional[str]:
    """The role a header's column name names: a role itself (`user`, `rating`, `item:genre`,
    `_`), or an id column named as ids are (`user_id`, `movieId`); None for any other name."""
    lower = name.lower()
    if lower in ROLES or name == IGNORED or re.fullmatch(r"(user|item):[A-Za-z0-9_]+", name):
        return lower if lower in ROLES else name
    return next((role for role in ("user", "item") if _names_ids(name, role)), None)


def known_layout(path: str) -> Optional[Tuple[str, bool]]:
    """(delimiter, header) of a MovieLens ratings file, told by its first line: ratings.csv's
    header under any name; u.data's or ratings.dat's four numbers only under its own name (a
    hint: four numbers alone do not say which is the user), or None."""
    first = _first_line(path)
    if [f.strip().lower() for f in first.split(",")] == [f.lower() for f in MOVIELENS_HEADER]:
        return ",", True
    delimiter = HEADERLESS.get(Path(path).name)
    if delimiter is None:
        return None
    fields = first.split(delimiter)
    if not first.strip() or (len(fields) == 4 and all(_is_number(f) for f in fields)):
        return delimiter, False  # (an empty file: said later, as an empty log)
    return None


def _first_line(path: str) -> str:
    """The first non-blank line, without a byte-order mark, as latin-1 text."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(1 << 16)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror}); check --input")
    text = _text(head, path).lstrip("\r\n")
    return text.split("\n", 1)[0].rstrip("\r")


def _text(raw: bytes, path: str) -> str:
    """A file's bytes as latin-1 text, which maps every byte to one character, so ids keep the
    file's bytes (UTF-8 or not); a byte-order mark dropped, and classic Mac OS line ends (a
    carriage return alone, in a file without a newline) read as newlines. An archive (MovieLens
    ships .zip files) is refused, not read as rows of binary."""
    archive = next((kind for kind, magic in ARCHIVES.items() if raw.startswith(magic)), None)
    if archive:
        raise DataError(f"{path}: a {archive} archive, not a text log; extract the log from it "
                        f"and give that")
    text = raw.removeprefix(b"\xef\xbb\xbf").decode("latin-1")
    return text.replace("\r", "\n") if "\n" not in text else text


def _fields(line: str, delimiter: str) -> List[str]:
    """One line's fields as csv reads them; a carriage return inside one is kept in it (csv
    refuses it): the field is then a bad row's, named as such."""
    fields = next(csv.reader([line.replace("\r", CR)], delimiter=delimiter), [])
    return [field.replace(CR, "\r") for field in fields]


def _sniff(path: str) -> str:
    first = _first_line(path).encode("latin-1")
    if not first.strip():
        return ","  # an empty file: said later, as an empty log
    for delimiter in ("::", "\t", ",", ";", "|"):
        if delimiter.encode() in first:
            return delimiter
    raise UserError(f"{path}:1: cannot tell the delimiter (no ::, tab, comma, ; or |); give "
                    f"--delimiter")


def read_log(paths: Sequence[str], columns: Optional[Tuple[str, ...]] = None,
             delimiter: Optional[str] = None, header: str = "auto", skip_bad: bool = False
             ) -> Log:
    """Every file's rows as one log; all files need the same columns."""
    log: Optional[Log] = None
    for path in paths:
        layout, sep, has_header = layout_of(path, columns, delimiter)
        if header != "auto":
            has_header = header == "yes"
        if log is not None and layout != log.layout:
            raise UserError(f"{path}: its columns ({','.join(layout)}) differ from "
                            f"{log.sources[0]}'s ({','.join(log.layout)}); give files of one "
                            f"layout")
        part = _read_file(path, layout, sep, has_header, skip_bad)
        if log is None:
            log = part
        else:
            log.columns = {k: np.concatenate([v, part.columns[k]]) for k, v in log.columns.items()}
            log.rows += part.rows
            log.bad = {k: n + part.bad[k] for k, n in log.bad.items()}
            log.sources += part.sources
    return log


def _read_file(path: str, layout: Tuple[str, ...], delimiter: str, header: Optional[bool],
               skip_bad: bool) -> Log:
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror}); check --input")
    text = _text(raw, path)
    if len(delimiter) > 1:
        text = text.replace(delimiter, SEPARATOR)
        delimiter = SEPARATOR
    text, first_line = _skip_header(text, layout, delimiter, header)
    try:
        log = _columns(path, _parse(io.StringIO(text), layout, delimiter), layout)
    except ValueError:  # a bad line: find it (and the others), line by line
        return _read_lines(path, text, first_line, layout, delimiter, skip_bad)
    if not _clean(log):
        return _read_lines(path, text, first_line, layout, delimiter, skip_bad)
    return log


def _parse(lines, layout: Sequence[str], delimiter: str) -> np.ndarray:
    """One structured row per line (`lines`: a text stream or a list of lines)."""
    width = ID_WIDTH
    while True:
        if not isinstance(lines, list):
            lines.seek(0)
        with warnings.catch_warnings():  # an empty file is said later, as an empty split
            warnings.filterwarnings("ignore", message=".*input contained no data")
            table = np.loadtxt(lines, delimiter=delimiter, quotechar='"', comments=None,
                               ndmin=1, dtype=_dtype(layout, width))
        if not _truncated(table, layout, width):
            return table
        width *= 4


def _dtype(layout: Sequence[str], width: int) -> list:
    return [(f"f{j}", "f8" if role in NUMBERS else "S1" if role == IGNORED else f"S{width}")
            for j, role in enumerate(layout)]


def _truncated(table: np.ndarray, layout: Sequence[str], width: int) -> bool:
    """Whether a value may have been cut at `width` bytes (it fills them)."""
    return any(np.char.str_len(table[f"f{j}"]).max() >= width for j, role in enumerate(layout)
               if role not in NUMBERS and role != IGNORED and len(table))


def _columns(path: str, table: np.ndarray, layout: Sequence[str]) -> Log:
    columns = {role: np.ascontiguousarray(table[f"f{j}"]) for j, role in enumerate(layout)
               if role != IGNORED}
    return Log(columns, tuple(layout), rows=len(table), sources=[path])


def _clean(log: Log) -> bool:
    """No empty or unwritable id and no nan or infinite number (np.loadtxt reads them all)."""
    return (all((log.columns[r] != b"").all() for r in ("user", "item"))
            and all(np.isfinite(log.columns[r]).all() for r in NUMBERS if r in log.columns)
            and not any(_id_problem(raw) for r in ("user", "item")
                        for raw in np.unique(log.columns[r]).tolist()))


def _id_problem(raw: bytes) -> Optional[str]:
    """Why an id cannot be written as one line of users.txt/items.txt and read back the same,
    or None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "is not UTF-8 text (save the log as UTF-8)"
    found = LINE_BREAKS.search(text)
    return None if found is None else f"holds a line break (U+{ord(found.group()):04X})"


def _skip_header(text: str, layout: Sequence[str], delimiter: str, header: Optional[bool]
                 ) -> Tuple[str, int]:
    """(the text after a header line, the file line number its first line has)."""
    blank = len(text) - len(text.lstrip("\r\n"))
    lines_before = text.count("\n", 0, blank)
    end = text.find("\n", blank)
    first = text[blank:] if end < 0 else text[blank:end]
    if header is None:
        header = _looks_like_header(_fields(first.rstrip("\r"), delimiter), layout)
    if not header:
        return text, 1
    return ("" if end < 0 else text[end + 1:]), lines_before + 2


def _looks_like_header(fields: List[str], layout: Sequence[str]) -> bool:
    if len(fields) != len(layout):
        return False
    if any(f.strip().lower() == role for f, role in zip(fields, layout) if role != IGNORED):
        return True
    if all(_names_ids(f, role) for f, role in zip(fields, layout) if role in ("user", "item")):
        return True  # both id columns named as ids are (a row of ids needs no such luck)
    return any(not _is_number(f) for f, role in zip(fields, layout) if role in NUMBERS)


def _names_ids(field: str, role: str) -> bool:
    """Whether `field` reads as the name of `role`'s id column: user_id, userId, movie, ..."""
    word = re.sub(r"[\s_\-]", "", field.lower())
    return any(word in (name, f"{name}id", f"{name}s") for name in ID_NAMES[role]) or \
        word == f"{role[0]}id"


def _is_number(text: str) -> bool:
    try:
        return np.isfinite(float(text))
    except ValueError:
        return False


def _read_lines(path: str, text: str, first_line: int, layout: Tuple[str, ...],
                delimiter: str, skip_bad: bool) -> Log:
    """The slow path: every line checked; the good ones parsed as the fast path does."""
    good: List[str] = []
    bad = dict.fromkeys(BAD_KINDS, 0)
    lines = text.split("\n")
    for number, line in enumerate(lines, first_line):
        if not line.strip("\r"):
            continue  # a blank line is no row
        fields = _fields(line.rstrip("\r"), delimiter)
        problem = _problem(fields, layout)
        if problem is None:
            good.append(line)
            continue
        kind, message = problem
        if not skip_bad:
            raise DataError(f"{path}:{number}: {message}; correct the line, or pass "
                            f"--skip-bad-rows to leave out such lines (counted)")
        bad[kind] += 1
    table = _parse(good, layout, delimiter)
    log = _columns(path, table, layout)
    log.bad, log.rows = bad, len(table) + sum(bad.values())
    return log


def _problem(fields: List[str], layout: Sequence[str]) -> Optional[Tuple[str, str]]:
    """(kind, message) of what is wrong with a line's fields, or None."""
    if len(fields) != len(layout):
        return "wrong_field_count", BAD_KINDS["wrong_field_count"].format(
            n=len(fields), width=len(layout), columns=",".join(layout))
    for value, role in zip(fields, layout):
        if role in ("user", "item") and not value:
            return "empty_id", BAD_KINDS["empty_id"].format(what=f"{role} id")
        is_id = role in ("user", "item")
        why = (_id_problem(value.encode("latin-1")) if is_id else
               "holds a line break (U+000D)" if "\r" in value and role not in NUMBERS else None)
        if why:  # (a carriage return in any other column: np.loadtxt reads no such line)
            raw = value.encode("latin-1")
            shown = (value if not is_id else raw if why.startswith("is not")
                     else raw.decode("utf-8"))
            what = f"{role} id" if is_id else f"{role} value"
            return "bad_id", BAD_KINDS["bad_id"].format(what=what, value=shown, why=why)
        if role in NUMBERS and not _is_number(value):
            return "bad_number", BAD_KINDS["bad_number"].format(what=role, value=value)
    return None

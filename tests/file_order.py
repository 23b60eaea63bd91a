"""Test files slowest first under `make test`'s `--dist loadfile`: xdist hands the files out in
the order the workers collected them (by default, most tests first), and the files with few
but slow tests came last, one worker finishing them while the other sat idle. Ordered by
tests/durations.json, the files left at the end are the short ones; a file the table lacks
goes first (a new file is not known to be short)."""

from __future__ import annotations

import json
import math

import pytest

from suite_timing import TABLE


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """loadfile in the order of the workers' collection (below), not by number of tests."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker: the files in their own order
        return
    seconds = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    # a stable sort: each file's tests stay together and in order
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], math.inf))

"""`python -m dlrm_hybrid plan`: the GPU-free dry run, its plan file, and training from it."""

import json

import pytest

from conftest import run_cli
from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.parallel.placement import plan_tables
from dlrm_hybrid.parallel.plan_file import check_plan, load_plan, save_plan
from dlrm_hybrid.parallel.tables import TableSpec


def imbalances(stdout: str) -> dict:
    """{strategy: {memory, a2a, lookup}} from the printed `imbalance ...` lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("imbalance "):
            words = line.split()
            out[words[1]] = {words[i]: float(words[i + 1]) for i in range(3, len(words), 2)}
    return out


def test_fl15_on_8x80gib_greedy_beats_nvidia_and_balances_all_to_all():
    result = run_cli(["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "8",
                      "--gpu-memory", "80GiB", "--compare"])
    assert result.returncode == 0, result.stderr
    found = imbalances(result.stdout)
    assert set(found) == {"greedy", "nvidia"}
    assert found["greedy"]["memory"] <= found["nvidia"]["memory"]
    assert found["greedy"]["a2a"] <= 1.10
    assert "plan (greedy)" in result.stdout and "plan (nvidia)" in result.stdout
    assert "greedy memory" in result.stdout  # the side-by-side table


def test_mlperf_dcnv2_fits_8x80gib_balanced_and_not_1x80gib(tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli(["plan", "--config", "configs/mlperf_dcnv2.yaml", "--world-size", "8",
                      "--gpu-memory", "80GiB", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert plan["imbalance"]["memory"] <= 1.10
    assert any(t["sharding"] == "column_wise" for t in plan["tables"].values())
    one = run_cli(["plan", "--config", "configs/mlperf_dcnv2.yaml", "--world-size", "1",
                   "--gpu-memory", "80GiB"])
    assert one.returncode == 2
    (line,) = one.stderr.strip().splitlines()
    assert line.startswith("error: table t_cat_") and "38.1GiB" in line
    assert "free in total" in line and "ranks of 76.0GiB would hold them" in line


def test_plan_file_has_the_documented_fields(tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli(["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "16",
                      "--gpus-per-node", "8", "--out", str(out), "--plot", str(tmp_path / "p.png")])
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert plan["world_size"] == 16 and plan["strategy"] == "greedy"
    assert len(plan["tables"]) == 26 and len(plan["ranks"]) == 16
    for name, table in plan["tables"].items():
        assert table["sharding"] in ("table_wise", "column_wise")
        assert sum(table["columns"]) == 128 and len(table["ranks"]) == len(table["columns"])
        assert table["bytes"] > 0
    assert [r["host"] for r in plan["ranks"]] == [0] * 8 + [1] * 8
    assert all({"rank", "tables", "bytes", "a2a_bytes"} <= set(r) for r in plan["ranks"])
    assert set(plan["imbalance"]) >= {"memory", "a2a"}
    assert result.stdout.count("(host total)") == 2
    for key in ("bytes", "a2a_bytes"):  # hosts are balanced too
        per_host = [sum(r[key] for r in plan["ranks"] if r["host"] == h) for h in (0, 1)]
        assert max(per_host) / (sum(per_host) / 2) <= 1.10
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cardinalities_file_replaces_the_tables(tmp_path):
    rows = tmp_path / "rows.txt"
    rows.write_text("1000, 2000\n3000\n")
    args = ["plan", "--config", "configs/demo.yaml", "--world-size", "2", "--cardinalities",
            str(rows), "--out", str(tmp_path / "p.json")]
    mismatch = run_cli(args)  # the demo's 8 per-table hotness values cannot fit 3 tables
    assert mismatch.returncode == 2 and "data.hotness: 8 values for 3 tables" in mismatch.stderr
    result = run_cli(args + ["--set", "data.hotness=[2]"])
    assert result.returncode == 0, result.stderr
    tables = json.loads((tmp_path / "p.json").read_text())["tables"]
    assert [(t["rows"], t["dim"], t["hotness"]) for t in tables.values()] == [
        (1000, 16, 2), (2000, 16, 2), (3000, 16, 2)]


@pytest.mark.parametrize("content, needle", [("10, x, 30", "'x'"), ("", "nothing")])
def test_bad_cardinalities_file_is_a_one_line_error(tmp_path, content, needle):
    rows = tmp_path / "rows.txt"
    rows.write_text(content)
    result = run_cli(["plan", "--config", "configs/criteo_1tb_fl15.yaml",
                      "--cardinalities", str(rows)])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(rows) in result.stderr and needle in result.stderr


def test_plan_file_round_trips(tmp_path):
    tables = [TableSpec("a", 5000, 16, "fp32", "adagrad", 2.0), TableSpec("b", 10, 16)]
    plan = plan_tables(tables, 3, 400_000, 512)  # table a (640 kB) must split
    assert plan.sharding_type("a") == "column_wise"
    save_plan(plan, tmp_path / "p.json")
    again = load_plan(str(tmp_path / "p.json"))
    assert sorted(again.shards, key=repr) == sorted(plan.shards, key=repr)
    assert again.tables == plan.tables and again.imbalance() == plan.imbalance()


def test_a_plan_for_other_ranks_or_tables_is_refused(tmp_path):
    tables = [TableSpec("a", 100, 16), TableSpec("b", 10, 16)]
    path = str(tmp_path / "p.json")
    save_plan(plan_tables(tables, 2, 10**6, 512), tmp_path / "p.json")
    plan = load_plan(path)
    with pytest.raises(ConfigError, match="is for 2 ranks, this job has 3"):
        check_plan(plan, path, tables, 3)
    with pytest.raises(ConfigError, match="table a is 100x16 in .* but 200x16 in the model"):
        check_plan(plan, path, [TableSpec("a", 200, 16), tables[1]], 2)
    with pytest.raises(ConfigError, match="table c is missing from the plan"):
        check_plan(plan, path, tables + [TableSpec("c", 1, 16)], 2)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a plan file"):
        load_plan(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("dim, columns, accepted", [
    (16, [12, 4], False),  # uneven: torchrec would build 8 + 8
    (20, [10, 10], False),  # torchrec would build one shard of 20 on the first rank
    (12, [4, 4, 2, 2], False),  # 12 does not split in 4: torchrec raises
    (12, [6, 6], False),  # widths fbgemm will not take
    (16, [8, 8], True),
    (12, [4, 4, 4], True),
    (20, [20], True),
])
def test_a_hand_edited_plan_with_column_shards_torchrec_will_not_build_is_refused(
        tmp_path, dim, columns, accepted):
    tables = [TableSpec("a", 100, dim)]
    path = tmp_path / "p.json"
    save_plan(plan_tables(tables, 4, 10**6, 512), path)
    raw = json.loads(path.read_text())
    raw["tables"]["a"].update(columns=columns, ranks=list(range(len(columns))))
    path.write_text(json.dumps(raw))
    if accepted:
        check_plan(load_plan(str(path)), str(path), tables, 4)
        return
    with pytest.raises(ConfigError) as info:
        check_plan(load_plan(str(path)), str(path), tables, 4)
    splits = {16: "1x16, 2x8, 4x4", 20: "1x20", 12: "1x12, 3x4"}[dim]  # on 4 ranks
    assert str(info.value) == (
        f"parallel.plan: table a in {path} has columns {columns}, a split torchrec does not "
        f"build; give it one of {splits} (count x width), or make the plan with `plan --out`")


def test_plan_with_its_defaults_draws_the_file_it_names(tmp_path):
    """Default config, 8 ranks, 80GiB less the reserve; a --plot name without a suffix is a PNG
    under that very name."""
    result = run_cli(["plan", "--plot", str(tmp_path / "chart")])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("plan (greedy): 3 tables, 8 shards on 8 ranks; budget 78.0GiB")
    assert result.stdout.strip().endswith(f"wrote {tmp_path / 'chart'}")
    assert [p.name for p in tmp_path.iterdir()] == ["chart"]
    assert (tmp_path / "chart").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("args, error", [
    (["--out", "{tmp}/missing/p.json"], "--out: folder {tmp}/missing does not exist; create it first"),
    (["--plot", "{tmp}/missing/p.png"], "--plot: folder {tmp}/missing does not exist; create it "
                                        "first"),
    (["--world-size", "0"], "--world-size: 0 must be at least 1"),
], ids=["out", "plot", "world-size"])
def test_plan_argument_errors_are_one_line(tmp_path, args, error):
    result = run_cli(["plan", *[a.format(tmp=tmp_path) for a in args]])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {error.format(tmp=tmp_path)}"]


def test_a_plot_name_matplotlib_cannot_write_is_refused():
    from dlrm_hybrid.parallel.plan_report import plot_format

    assert plot_format("p.SVG") == "svg" and plot_format("chart") == "png"
    with pytest.raises(ConfigError, match=r"--plot: p.json is no image name matplotlib writes; "
                                          r"end it in one of .*\.png"):
        plot_format("p.json")


@pytest.mark.parametrize("args, error", [
    (["--out", "{tmp}/p.png", "--plot", "{tmp}/./p.png"],
     "--plot: {tmp}/./p.png is --out {tmp}/p.png; give them different names"),
    (["--out", "{tmp}/" + "p" * 300], "--out: cannot write {tmp}/" + "p" * 300 + " (File name too long)"),
    (["--out", "/proc/plan.json"], "--out: cannot write /proc/plan.json ("),  # procfs takes no file
], ids=["out-is-plot", "name-too-long", "unwritable"])
def test_plan_outputs_it_cannot_write_are_one_line_errors(tmp_path, args, error):
    from dlrm_hybrid.cli import _parser
    from dlrm_hybrid.errors import UserError
    from dlrm_hybrid.parallel import dry_run

    with pytest.raises(UserError) as e:  # the CLI's one line
        dry_run.run(_parser().parse_args(["plan", *[a.format(tmp=tmp_path) for a in args]]))
    assert str(e.value).startswith(error.format(tmp=tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_plan_or_plot_that_cannot_take_its_place_leaves_no_partial_file(tmp_path):
    from dlrm_hybrid.parallel.plan_report import plot

    plan = plan_tables([TableSpec("a", 100, 16)], 2, 10**6, 512)
    for taken in ("plan", "plot"):  # a folder in the way of the final rename
        (tmp_path / taken / "x").mkdir(parents=True)
    with pytest.raises(OSError):
        save_plan(plan, tmp_path / "plan")
    with pytest.raises(OSError):
        plot([plan], tmp_path / "plot")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan", "plot"]

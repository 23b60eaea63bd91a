"""`python -m dlrm_hybrid plan`: the GPU-free dry run, its plan file, and training from it."""

import json
import re

import pytest

from conftest import run_cli
from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.parallel.greedy_search import plan_tables
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


def modeled(stdout: str) -> dict:
    """{strategy: (max ms, MiB sent in all)} from the printed `modeled step ...` lines."""
    found = re.findall(r"^modeled step (\w+): max ([\d.]+) ms .* all-to-all ([\d.]+) MiB sent",
                       stdout, re.M)
    return {name: (float(ms), float(mib)) for name, ms, mib in found}


def test_fl15_on_8x80gib_greedy_beats_nvidia_modeled_in_fewer_bytes():
    """Memory balance is no longer greedy's goal (it is a limit); its modeled step is."""
    result = run_cli(["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "8",
                      "--gpu-memory", "80GiB", "--compare"])
    assert result.returncode == 0, result.stderr
    assert set(imbalances(result.stdout)) == {"greedy", "nvidia"}
    found = modeled(result.stdout)
    assert found["greedy"][0] < found["nvidia"][0] and found["greedy"][1] <= found["nvidia"][1]
    assert "plan (greedy)" in result.stdout and "plan (nvidia)" in result.stdout
    assert "greedy memory" in result.stdout  # the side-by-side table


@pytest.fixture(scope="module")
def fl15_at_64(tmp_path_factory):
    out = tmp_path_factory.mktemp("fl15") / "plan.json"
    result = run_cli(["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "64",
                      "--gpus-per-node", "8", "--compare", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    return result.stdout, json.loads(out.read_text())


def test_fl15_on_64_ranks_replicates_tiny_tables_and_beats_nvidia_in_fewer_bytes(fl15_at_64):
    """At 64 ranks in hosts of 8 the old placer cut the tables into 544 shards (a 4-row table
    8 ways) and sent 23% more bytes than nvidia, most across hosts."""
    stdout, plan = fl15_at_64
    found = modeled(stdout)
    assert found["greedy"][0] < found["nvidia"][0]
    assert found["greedy"][1] <= found["nvidia"][1]
    tables = plan["tables"]
    assert sum(len(t["ranks"]) for t in tables.values()) <= 26  # no table split
    for name in ("t_cat_5", "t_cat_16"):  # 4 rows each
        assert tables[name]["sharding"] == "data_parallel" and tables[name]["ranks"] == []
    assert "replicated on every rank (data_parallel, in each rank's figures): " in stdout


def test_the_demo_on_2_cpu_ranks_shards_tables_beside_replicated_ones(tmp_path):
    """`make demo` (2 gloo ranks where there is no GPU) must run what the product is about:
    sharded tables whose ids and pooled vectors cross the all-to-all, beside replicated ones."""
    out = tmp_path / "plan.json"
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2", "--device",
                      "cpu_gloo", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    shardings = {name: t["sharding"] for name, t in json.loads(out.read_text())["tables"].items()}
    assert "table_wise" in shardings.values() and "data_parallel" in shardings.values(), shardings
    assert shardings["t_cat_0"] == "table_wise"  # the largest table


def test_demo_on_4_ranks_splits_no_table_and_prints_the_modeled_step(tmp_path):
    """Row-wise Adagrad (the demo's) keeps a statistic per row of each shard: the 4-rank plan
    splits nothing, so it trains as the 1-rank run does."""
    out = tmp_path / "plan.json"
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "4",
                      "--out", str(out)])
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert all(t["sharding"] != "column_wise" for t in plan["tables"].values())
    assert "warning:" not in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("host"))
    assert header.split()[-7:] == ["step", "lookup", "intra", "inter", "fixed", "allred", "tables"]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("modeled step")]
    assert "h100: memory 3.35 TB/s" in line and "10 us per message" in line
    steps = [sum(r["step_s"].values()) for r in plan["ranks"]]
    assert f"max {1e3 * max(steps):.3f} ms" in line and plan["modeled_max_step_s"] == max(steps)


ROWWISE_SPLIT = ["plan", "--config", "configs/demo.yaml", "--world-size", "4",
                 "--set", "data.cardinalities=[3000000,10]", "--set", "data.hotness=[1]"]


def test_a_rowwise_table_is_split_only_where_memory_forces_it_and_the_plan_says_so():
    """3,000,000 x 16 with row-wise state is 195 MiB: whole on 80 GiB ranks; on 100 MiB for
    tables it must be cut, and the printout says its updates will differ and what to do."""
    roomy = run_cli(ROWWISE_SPLIT)
    assert roomy.returncode == 0, roomy.stderr
    assert "t_cat_0[" not in roomy.stdout and "warning:" not in roomy.stdout
    tight = run_cli(ROWWISE_SPLIT + ["--gpu-memory", "2148MiB"])  # less the 2 GiB reserve
    assert tight.returncode == 0, tight.stderr
    assert "t_cat_0[0:" in tight.stdout
    (warning,) = [line for line in tight.stdout.splitlines() if line.startswith("warning:")]
    assert warning.startswith("warning: t_cat_0 split column-wise keep rowwise_adagrad state per "
                              "row of each shard, so their updates differ from an unsplit run's")
    assert "parallel.memory_per_rank" in warning and "sgd or adagrad" in warning


def test_explain_prints_every_sharding_with_its_modeled_step_and_marks_the_choice():
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "4",
                      "--explain", "t_cat_0"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("t_cat_0: 2,000 rows x 16, rowwise_adagrad")
    options = [re.match(r"([* ]) (\w+(?: x\d+)?) +([\d.]+) ", line) for line in lines[2:-1]]
    assert [m[2] for m in options] == ["table_wise", "column_wise x2", "column_wise x4",
                                       "data_parallel"]  # 16 columns split in 2 or 4
    # replicated like every demo table: no all-to-all at all, the fastest of the four
    assert [m[1] for m in options] == [" ", " ", " ", "*"]
    assert all(float(m[3]) > float(options[-1][3]) for m in options[:-1])
    for line in lines[3:5]:
        assert line.endswith("(rowwise_adagrad keeps state per row of each shard: the split "
                             "changes its updates (parallel.split_rowwise))")
    assert lines[-1] == "* the plan's choice"


def test_explain_of_an_unknown_table_is_one_line():
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--explain", "cat_0"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --explain: no table cat_0; the plan printout (without --explain) lists the names"]


@pytest.mark.parametrize("setting, error", [
    ("parallel.cost_model.hbm=1", "parallel.cost_model.hbm: unknown constant; set one of "
                                  "memory_bandwidth, intra_host_bandwidth"),
    ("parallel.cost_model.shard_fixed_s=0", "parallel.cost_model.shard_fixed_s: must be a "
                                            "positive number (bytes/s or seconds), got 0.0"),
    ("parallel.device=tpu", "parallel.device: 'tpu' is not one of auto, h100, h200, a100, cpu_gloo"),
])
def test_cost_model_settings_a_user_got_wrong_are_one_line_errors(setting, error):
    result = run_cli(["plan", "--set", setting])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {error}")


def test_device_and_cost_model_overrides_change_the_modeled_step():
    result = run_cli(["plan", "--device", "a100", "--set", "parallel.cost_model.message_fixed_s=1e-3"])
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("modeled step")]
    assert "a100: memory 2 TB/s" in line and "1000 us per message" in line
    assert "parallel.cost_model sets message_fixed_s" in line


def test_mlperf_dcnv2_fits_8x80gib_balanced_and_not_1x80gib(tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli(["plan", "--config", "configs/mlperf_dcnv2.yaml", "--world-size", "8",
                      "--gpu-memory", "80GiB", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert any(t["sharding"] == "column_wise" for t in plan["tables"].values())  # Adagrad: exact
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
        assert table["sharding"] in ("table_wise", "column_wise", "data_parallel")
        assert sum(table["columns"]) == (0 if table["sharding"] == "data_parallel" else 128)
        assert len(table["ranks"]) == len(table["columns"]) and table["bytes"] > 0
    assert [r["host"] for r in plan["ranks"]] == [0] * 8 + [1] * 8
    assert all({"rank", "tables", "bytes", "a2a_bytes", "step_s"} <= set(r) for r in plan["ranks"])
    assert set(plan["imbalance"]) >= {"memory", "a2a"}
    assert plan["device"]["name"] == "h100" and plan["modeled_max_step_s"] > 0
    assert result.stdout.count("(host total)") == 2
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cardinalities_file_replaces_the_tables(tmp_path):
    rows = tmp_path / "rows.txt"
    rows.write_bytes("\ufeff1000, 2000\r\n3000\r\n\r\n".encode())  # as a spreadsheet saves it
    args = ["plan", "--config", "configs/demo.yaml", "--world-size", "2", "--cardinalities",
            str(rows), "--out", str(tmp_path / "p.json")]
    mismatch = run_cli(args)  # the demo's 8 per-table hotness values cannot fit 3 tables
    assert mismatch.returncode == 2 and "data.hotness: 8 values for 3 tables" in mismatch.stderr
    result = run_cli(args + ["--set", "data.hotness=[2]"])
    assert result.returncode == 0, result.stderr
    tables = json.loads((tmp_path / "p.json").read_text())["tables"]
    assert [(t["rows"], t["dim"], t["hotness"]) for t in tables.values()] == [
        (1000, 16, 2), (2000, 16, 2), (3000, 16, 2)]


@pytest.mark.parametrize("content, needle", [
    (b"10, x, 30", "'x'"), (b"", "nothing"), ("10\n2\u00b2\n".encode(), "'2\u00b2'"),
    (b"\x89PNG\r\n\x1a\n\xb7", "is not text (UTF-8)")])
def test_bad_cardinalities_file_is_a_one_line_error(tmp_path, content, needle):
    rows = tmp_path / "rows.txt"
    rows.write_bytes(content)
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
    edited = tmp_path / "edited.json"  # saved again by an editor: a byte-order mark, CRLF
    text = (tmp_path / "p.json").read_bytes()
    edited.write_bytes("\ufeff".encode() + text.replace(b"\n", b"\r\n"))
    assert sorted(load_plan(str(edited)).shards, key=repr) == sorted(plan.shards, key=repr)


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


def test_a_hand_edited_plan_torchrec_would_not_build_as_written_is_refused(tmp_path):
    """A sharding this trainer does not build, or a replicated table whose optimizer would
    update it unlike a sharded one (Adam's moments decay on rows no sample touched)."""
    tables = [TableSpec("a", 100, 16, optimizer="adam"), TableSpec("b", 10, 16)]
    path = tmp_path / "p.json"
    save_plan(plan_tables(tables, 2, 10**6, 512), path)
    raw = json.loads(path.read_text())
    raw["tables"]["a"].update(sharding="data_parallel", ranks=[], columns=[])
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        check_plan(load_plan(str(path)), str(path), tables, 2)
    assert str(info.value) == (
        f"parallel.plan: table a is replicated (data_parallel) in {path}, but adam would update "
        f"a replicated table unlike a sharded one; shard it, or train it with sgd, "
        f"rowwise_adagrad, adagrad")
    raw["tables"]["a"].update(sharding="row_wise", ranks=[0], columns=[16])
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"table a in .* has sharding 'row_wise'; this trainer "
                                          r"builds table_wise, column_wise, data_parallel"):
        load_plan(str(path))
    raw["tables"]["b"].update(sharding="data_parallel", ranks=[], columns=[])
    raw["tables"]["a"].update(sharding="table_wise", ranks=[0], columns=[16])
    path.write_text(json.dumps(raw))  # sgd's replicated update is the sharded one's
    check_plan(load_plan(str(path)), str(path), tables, 2)


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
    raw["tables"]["a"].update(sharding="column_wise", columns=columns,
                              ranks=list(range(len(columns))))
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
    # its three small tables are cheaper replicated than sent to and fro
    assert result.stdout.startswith("plan (greedy): 3 tables, 0 shards on 8 ranks; budget 78.0GiB")
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


@pytest.mark.parametrize("setting", ["parallel.exchange=des", "train.precision=fp16",
                                     "parallel.replicate=false"])
def test_a_config_that_cannot_train_replicated_tables_gets_none(setting):
    """The des exchange and fp16's loss scaler refuse replicated tables at start: the plan made
    for such a job must shard every table, as where the config says so; --explain says why."""
    args = ["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "64",
            "--gpus-per-node", "8", "--set", "model.interaction=cat", "--set", setting]
    result = run_cli(args)
    assert result.returncode == 0, result.stderr
    assert "replicated on every rank" not in result.stdout
    explained = run_cli(args + ["--explain", "t_cat_5"])
    (line,) = [line for line in explained.stdout.splitlines() if "data_parallel" in line]
    assert "parallel.replicate is false, or the job asks for the des exchange or fp16" in line


DHEN_PLAN = ["plan", "--config", "configs/demo.yaml", "--world-size", "8", "--gpus-per-node", "4",
             "--set", "model.interaction=dhen", "--set", "optim.dense=adam",
             "--set", "model.dhen.modules=[linear,self_attention,conv,dot,dcn]",
             "--set", "parallel.reserve_per_rank=200KiB"]


def dense_block(stdout: str) -> dict:
    """{parameters, units, mine, others, verdict} from the printed dense part."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("dense part: "))
    end = lines.index("", start)
    block = lines[start:end]
    return {"parameters": int(block[0].split()[2].replace(",", "")),
            "units": {line[2:20].strip(): int(line[20:34].replace(",", ""))
                      for line in block[1:-3]},
            "mine": block[-3], "others": block[-2], "verdict": block[-1]}


def test_plan_reports_dense_bytes_per_rank_and_fsdp_makes_a_tight_reserve_fit():
    """200KiB per rank holds neither the replicated DHEN with Adam nor hsdp's shards of 4 (one
    host), only fsdp's of 8: `plan` says so and still plans; under fsdp it fits."""
    from dlrm_hybrid.parallel.plan import format_bytes

    ddp = run_cli(DHEN_PLAN)
    assert ddp.returncode == 0, ddp.stderr
    block = dense_block(ddp.stdout)
    assert list(block["units"]) == ["bottom MLP", "dhen layer 1", "dhen layer 2", "top MLP"]
    assert sum(block["units"].values()) == block["parameters"]
    assert block["mine"].startswith(f"dense per rank, parallel.dense=ddp (replicated): "
                                    f"{format_bytes(16 * block['parameters'])} = ")  # 4+4+8 B
    assert block["mine"].endswith("; activations not counted")
    assert "fsdp 158.2KiB (sharded over 8 ranks); hsdp 220.5KiB (sharded over 4 ranks)" \
        in block["others"]
    assert block["verdict"] == ("dense part does not fit in parallel.reserve_per_rank 200KiB: use "
                                "parallel.dense=fsdp (158.2KiB), or raise "
                                "parallel.reserve_per_rank to 510.9KiB")
    fsdp = run_cli(DHEN_PLAN + ["--set", "parallel.dense=fsdp"])
    assert fsdp.returncode == 0, fsdp.stderr
    block = dense_block(fsdp.stdout)
    assert block["mine"].startswith("dense per rank, parallel.dense=fsdp (sharded over 8 ranks): "
                                    "158.2KiB = ")
    assert "all-gather of the largest unit (top MLP)" in block["mine"]
    assert block["verdict"] == "dense part fits in parallel.reserve_per_rank 200KiB"


def test_a_training_job_whose_dense_part_does_not_fit_its_reserve_stops_at_start(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["train", "--config", "configs/demo.yaml", "--set", "train.max_steps=2",
                      "--set", "parallel.reserve_per_rank=64KiB", "--set",
                      f"train.run_dir={run_dir}"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: parallel.reserve_per_rank: the dense part needs 92.4KiB per rank under "
        "parallel.dense=ddp (parameters, gradients, adagrad state), more than the 64KiB kept free "
        "of tables; raise parallel.reserve_per_rank to 92.5KiB"]
    assert not run_dir.exists()


def test_a_compositional_config_lists_each_replaced_table_and_places_its_parts(tmp_path):
    """MLPerf DCNv2 with QR on its five 40M-row features: the printout names each with its parts
    and the plan places those parts, not the full tables (one set of lookups for both)."""
    result = run_cli(["plan", "--config", "configs/mlperf_dcnv2_qr.yaml", "--world-size", "8",
                      "--out", str(tmp_path / "p.json")])
    assert result.returncode == 0, result.stderr
    replaced = (0, 9, 19, 20, 21)
    listed = re.findall(r"^  (cat_\d+) \([\d,]+ rows\): qr add c=4 -> (t_cat_\d+_q) ",
                        result.stdout, re.M)
    assert sorted(listed) == sorted((f"cat_{i}", f"t_cat_{i}_q") for i in replaced)
    tables = set(json.loads((tmp_path / "p.json").read_text())["tables"])
    assert {f"t_cat_{i}_{part}" for i in replaced for part in "qr"} <= tables
    assert not tables & {f"t_cat_{i}" for i in replaced}

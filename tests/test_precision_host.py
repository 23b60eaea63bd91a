"""Whether a CPU computes bf16/fp16 natively, decided from its /proc/cpuinfo flags for each kind
of host in the fleet (fixtures: the first processor's lines that matter), and what `bench` does
where the decision is "AVX-512 without bf16"."""

import pytest
import torch

from test_speed import check_report, run_bench
from dlrm_hybrid.train.precision import emulation_reason


def cpuinfo(model_name: str, flags: str) -> str:
    """The lines of /proc/cpuinfo that matter, as the kernel writes them."""
    return f"model name\t: {model_name}\nflags\t\t: {' '.join(flags.split())}\n"


AMX_XEON = cpuinfo("Intel(R) Xeon(R) Platinum 8480+", """
    fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx pdpe1gb rdtscp
    lm constant_tsc pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes
    xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch fsgsbase bmi1 avx2 smep bmi2
    erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni
    avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat
    avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni
    avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b md_clear serialize
    amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities""")
AVX512_XEON = cpuinfo("Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz", """
    fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ss ht syscall nx pdpe1gb
    rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe
    popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch fsgsbase bmi1 avx2
    smep bmi2 erms invpcid mpx avx512f avx512dq rdseed adx smap clflushopt clwb avx512cd
    avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves ida arat pku ospke avx512_vnni""")
AVX2_EPYC = cpuinfo("AMD EPYC 7R13 Processor", """
    fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext fxsr_opt
    pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic
    movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm
    sse4a misalignsse 3dnowprefetch topoext fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed
    adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr rdpru
    wbnoinvd arat npt nrip_save vaes vpclmulqdq rdpid""")
ZEN4_EPYC = cpuinfo("AMD EPYC 9R14", """
    fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext fxsr_opt
    pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic
    movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm
    sse4a misalignsse 3dnowprefetch topoext fsgsbase bmi1 avx2 smep bmi2 erms invpcid
    avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw
    avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr arat avx512vbmi
    umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid
    fsrm""")
NO_BF16 = "no avx512_bf16 or amx_bf16"
NO_FP16 = "no avx512_fp16 or amx_fp16"


@pytest.mark.parametrize("cpuinfo, bf16, fp16", [
    (AMX_XEON, None, None),
    (AVX512_XEON, NO_BF16, NO_FP16),  # oneDNN says bf16 here, and converts: 3-5x slower
    (AVX2_EPYC, NO_BF16, NO_FP16),
    (ZEN4_EPYC, None, NO_FP16),
    ("", NO_BF16, NO_FP16),  # no /proc/cpuinfo: nothing is assumed
])
def test_each_host_kind_is_native_only_with_the_instructions(cpuinfo, bf16, fp16):
    assert emulation_reason(torch.bfloat16, cpuinfo, {}) == bf16
    assert emulation_reason(torch.float16, cpuinfo, {}) == fp16
    assert emulation_reason(torch.float32, cpuinfo, {}) is None


@pytest.mark.parametrize("env, bf16, fp16", [
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "ONEDNN_MAX_CPU_ISA=AVX512_CORE",
     "ONEDNN_MAX_CPU_ISA=AVX512_CORE"),  # an AVX-512 Xeon without bf16, emulated
    ({"DNNL_MAX_CPU_ISA": "avx2"}, "ONEDNN_MAX_CPU_ISA=AVX2", "ONEDNN_MAX_CPU_ISA=AVX2"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, None, "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, None, None),
    ({"ONEDNN_MAX_CPU_ISA": "DEFAULT"}, None, None),
])
def test_a_onednn_isa_limit_takes_the_instructions_away(env, bf16, fp16):
    assert emulation_reason(torch.bfloat16, AMX_XEON, env) == bf16
    assert emulation_reason(torch.float16, AMX_XEON, env) == fp16


def test_bench_on_an_avx512_cpu_without_bf16_runs_bf16_in_fp32_and_says_so():
    """oneDNN limited to AVX-512 (no bf16 instructions) still reports bf16 support; a bf16 step
    there is slower than fp32, so bench falls back, saying so in one line."""
    lines, fields, stderr = run_bench("train.precision=bf16",
                                      extra_env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    check_report(lines, fields, "fp32")
    assert fields["requested"] == "bf16"
    assert fields["cpu"].endswith(",bf16-emulated,fp16-emulated")
    said = [line for line in stderr.splitlines() if "train.precision:" in line]
    assert len(said) == 1, stderr
    assert said[0].endswith(
        f"train.precision: this CPU ({torch.backends.cpu.get_cpu_capability()}, "
        f"ONEDNN_MAX_CPU_ISA=AVX512_CORE) has no native bf16 matmul (a step 3-24x slower than "
        f"fp32); computing in fp32 (set train.precision_fallback=false to insist)")


def _rank_deciding(rank: int, init_file: str, out_dir: str) -> None:
    """One of two ranks on hosts of other CPUs: rank 0 an AMX Xeon, rank 1 one limited to
    AVX2 (oneDNN's own check stubbed: the decision must not hang on this test's host)."""
    import json
    import os

    import torch.distributed as dist
    from dlrm_hybrid.train import precision

    torch.set_num_threads(1)
    os.environ["ONEDNN_MAX_CPU_ISA"] = "DEFAULT" if rank == 0 else "AVX2"
    precision._cpuinfo = lambda: AMX_XEON
    precision.onednn_has_kernel = lambda dtype: True
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ran = {name: precision.effective_precision(name, torch.device("cpu"))
           for name in ("bf16", "fp16")}
    with open(f"{out_dir}/rank_{rank}.json", "w") as f:
        json.dump(ran, f)
    dist.destroy_process_group()
    os._exit(0)  # as test_fp16_skip.py's ranks: gloo's threads torn down at exit may abort


def test_ranks_on_other_cpus_fall_back_together(tmp_path):
    """A job over hosts of other CPUs: one rank without native fp16 computed fp32 while the
    others ran fp16 with its loss scaler, whose per-step collective the fp32 rank never joined
    (a hang). Any rank's fallback is every rank's."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_rank_deciding, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="fork")
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert ranks == [{"bf16": "fp32", "fp16": "fp32"}] * 2

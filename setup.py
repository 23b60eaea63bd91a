from setuptools import Extension, find_packages, setup

setup(
    name="dlrm_hybrid",
    version="0.1.0",
    description="Hybrid-parallel DLRM training: model-parallel embeddings, data-parallel MLPs",
    packages=find_packages(include=["dlrm_hybrid", "dlrm_hybrid.*"]),
    python_requires=">=3.10",
    # None here: `make install` (install/setup_env.py) installs them, a run's from
    # requirements.txt (requirements-gpu.txt with the CUDA build; requirements-dev.txt for
    # `make test`), since fbgemm-gpu and torchrec must be the pair built for the torch found
    # (install/torch_versions.txt), fbgemm in the build the machine loads (CPU or CUDA), and
    # torchrec with --no-deps, as it declares the CUDA build, which fails to load on a CPU
    # machine and overwrites the CPU build's files.
    install_requires=[],
    # A plain C library loaded with ctypes (no Python API inside): the CPU embedding id check and
    # SGD update, see dlrm_hybrid/parallel/cpu_lookup.py. Without it those run in fbgemm.
    ext_modules=[Extension("dlrm_hybrid._cpu_lookup", ["dlrm_hybrid/csrc/cpu_lookup.c"],
                           extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"]),
                 # The same: the Criteo preprocessing kernels, see dlrm_hybrid/data/criteo/native.py.
                 Extension("dlrm_hybrid._criteo", ["dlrm_hybrid/csrc/criteo.c"],
                           extra_compile_args=["-O3"])],
    entry_points={"console_scripts": ["dlrm-hybrid=dlrm_hybrid.cli:main"]},
)

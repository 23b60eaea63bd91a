from setuptools import Extension, find_packages, setup

setup(
    name="dlrm_hybrid",
    version="0.1.0",
    description="Hybrid-parallel DLRM training: model-parallel embeddings, data-parallel MLPs",
    packages=find_packages(include=["dlrm_hybrid", "dlrm_hybrid.*"]),
    python_requires=">=3.10",
    # Installed by the Makefile because torchrec must go in with --no-deps and fbgemm must match
    # the machine (CPU or CUDA build); see DESIGN.md "Version set".
    install_requires=[],
    # A plain C library loaded with ctypes (no Python API inside): the embedding rows' SGD update
    # on CPU, see dlrm_hybrid/parallel/cpu_lookup.py. Without it that update runs in fbgemm.
    ext_modules=[Extension("dlrm_hybrid._sgd_rows", ["dlrm_hybrid/csrc/sgd_rows.c"],
                           extra_compile_args=["-O3"])],
    entry_points={"console_scripts": ["dlrm-hybrid=dlrm_hybrid.cli:main"]},
)

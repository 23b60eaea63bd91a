from setuptools import find_packages, setup

setup(
    name="dlrm_hybrid",
    version="0.1.0",
    description="Hybrid-parallel DLRM training: model-parallel embeddings, data-parallel MLPs",
    packages=find_packages(include=["dlrm_hybrid", "dlrm_hybrid.*"]),
    python_requires=">=3.10",
    # Installed by the Makefile (scripts/install.sh) because torchrec must go in with --no-deps
    # and fbgemm must match the machine (CPU or CUDA build); see DESIGN.md "Version set".
    install_requires=[],
    entry_points={"console_scripts": ["dlrm-hybrid=dlrm_hybrid.cli:main"]},
)

"""dlrm_hybrid: hybrid-parallel DLRM training (model-parallel embeddings, data-parallel MLPs)."""

__version__ = "0.1.0"

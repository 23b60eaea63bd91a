"""dlrm_hybrid: hybrid-parallel DLRM training (model-parallel embeddings, data-parallel MLPs)."""

from dlrm_hybrid.compat import install_import_filters

__version__ = "0.1.0"
install_import_filters()

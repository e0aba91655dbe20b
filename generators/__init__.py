"""Model and input generators, registered by model kind. One line per generator module."""

from generators import (
    dlrm,  # noqa: F401  (registers kind "dlrm")
    functional,  # noqa: F401  (registers kinds "keras-dag", "keras-transformer")
    sequential,  # noqa: F401  (registers kind "sequential")
    torchrec_models,  # noqa: F401  (registers kinds "torchrec-dlrm", "torchrec-deepfm")
    transformer,  # noqa: F401  (registers kind "transformer")
)
